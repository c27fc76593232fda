"""How a pruning run executes: the session around it (`session`), blocks streamed from disk for low-memory runs
(`streaming`, `sharded`), memory checks (`memory`) and resumable checkpoints (`checkpoint`)."""
