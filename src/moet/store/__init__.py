"""The residency ladder for routed experts: pack file on disk -> host arena -> device cache.

    pack = open_pack(ckpt, pack_dir, tag="w2")             # build / resume / repair / reuse
    arena = HostArena(pack, num_slots=...)                 # host rows, LRU, scan mode, hot set
    cache = ExpertCache(pack, num_slots, device, arena=arena)
    cache.attach(model.moe_blocks())                       # MoE layers read the cache's pool
    logits, res = run_with_replay(step, cache, miss_tolerance=0)

Files: pack_file.py (format, I/O, lock), pack_builder.py (streaming first boot, validation),
host_arena.py, expert_cache.py, replay.py (the miss policy the runner calls), prefetch.py (next
layer's experts guessed from this layer's hidden state, fetched early), plan.py (`moet plan`: placement
per tier and predicted decode tok/s for a GPU / host budget; plan_cli.py its command line).
"""
from moet.store.expert_cache import ExpertCache, min_cache_slots
from moet.store.host_arena import HostArena
from moet.store.pack_builder import expert_row_bytes, open_pack, pack_layers
from moet.store.pack_file import PackFile, PackMeta, RowLayout
from moet.store.prefetch import attach_prefetch, detach_prefetch
from moet.store.replay import StepResidency, run_with_replay

__all__ = ["ExpertCache", "HostArena", "PackFile", "PackMeta", "RowLayout", "StepResidency", "attach_prefetch",
           "detach_prefetch", "expert_row_bytes", "min_cache_slots", "open_pack", "pack_layers", "run_with_replay"]
