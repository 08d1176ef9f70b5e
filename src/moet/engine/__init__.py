"""The serving engine: continuous batching over a paged KV cache (nano-vllm's shape).

    sequence.py       Sequence + status
    block_manager.py  KV block pool, ref counts, prefix cache
    scheduler.py      waiting / running, token budget, chunked prefill, preemption
    sampler.py        batched deterministic sampling + logprobs
    detokenizer.py    incremental text + stop strings
    model_runner.py   model + KV cache, AttentionBatch, CUDA graphs
    llm_engine.py     add_request / abort_request / step
    async_engine.py   the server's interface (a background thread steps the engine)
    engine_process.py the same interface with the engine in a spawned child process
    stats.py          EngineStats
"""
