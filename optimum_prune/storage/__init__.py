"""Where a model's weights live while it is pruned or saved: blocks streamed from and to disk for low-memory runs
(`streaming`, `sharded`), the tensor files they use (`tensorfile`, `safetensors_io`) and memory checks (`memory`)."""
