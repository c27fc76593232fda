"""The pruning pipeline: what runs a config on a model. The stage context and its block loop (`stage`), the session
that finishes blocks, streams them and resumes (`session`, `checkpoint`, `progress`) and the cache of calibration
passes (`stats_cache`)."""
