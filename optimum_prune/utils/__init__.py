"""Low-level helpers with no knowledge of models or methods: process groups (`distributed`), scratch directories and
atomic writes (`scratch`), nested tensor moves (`tensors`) and `transformers.Trainer` plumbing (`training`)."""
