"""Pipeline-parallel serving across devices (one process per shard) and device-wise CacheFlow restoration.

``pipeline.launch(PipelineConfig(...), driver)`` starts one process per shard (torch.distributed: gloo on CPU,
NCCL on CUDA); rank 0 runs ``driver(engine)`` and drives ``engine.generate(...)``, the others follow.
"""
