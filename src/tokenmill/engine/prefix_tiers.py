"""The prefix cache's tiers for a built engine: `--prefix-cache-ram-gb`, `--prefix-cache-dir`, `--prefix-cache-disk-gb`
(kv_cache/tiers.py holds the blocks; this module decides whether they can be used and keys the disk tier).

The disk tier's folder is keyed by a digest of everything that fixes a block's bytes: the model's identity (its
resolved path, and the size, mtime and inode of its config and weight files), the dtype, the settings that change
the arithmetic (quantization, kernels, batch invariance) and the KV layout (layers, KV heads, head dim, block size).
A changed model or setting gets another folder, so it never reads stale blocks; the digest is in every file's header
too. A folder that cannot be used is one warning line, and serving goes on without the disk tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from tokenmill.assembly import LoadedModel
from tokenmill.attention import PagedKVCache, kv_quant
from tokenmill.config import EngineConfig
from tokenmill.kv_cache import DiskTier, KVCacheManager, KVManager, PrefixTiers

log = logging.getLogger("tokenmill.engine")
_WEIGHT_SUFFIXES = (".json", ".safetensors", ".gguf", ".bin")
_SETTINGS = ("quantization", "cpu_kernels", "pack_weights", "compile", "batch_invariant", "revision")  # change the sums


def attach_prefix_tiers(kv: KVManager, pool: PagedKVCache | None, loaded: LoadedModel, cfg: EngineConfig) -> None:
    """Give `kv` the tiers `cfg` asks for, where they can work; where they cannot, one warning line says why."""
    if cfg.prefix_cache_ram_gb == 0 and cfg.prefix_cache_dir is None:
        return
    reason = _refusal(kv, pool, cfg)
    if reason is not None or not isinstance(kv, KVCacheManager) or pool is None:
        log.warning("prefix cache: no RAM or disk tier: %s", reason)
        return
    identity = model_identity(loaded, cfg, pool)
    disk = _disk_tier(cfg, identity, pool.block_nbytes)
    ram_bytes = int(cfg.prefix_cache_ram_gb * 2**30)
    if ram_bytes < pool.block_nbytes and disk is None:
        return
    kv.use_tiers(PrefixTiers(pool.block_nbytes, ram_bytes, disk))
    log.info("prefix cache tiers: RAM %.2f GiB, disk %s", ram_bytes / 2**30,
             f"{disk.folder} ({cfg.prefix_cache_disk_gb:g} GiB)" if disk else "off")  # fmt: skip


def _refusal(kv: KVManager, pool: PagedKVCache | None, cfg: EngineConfig) -> str | None:
    """Why the tiers cannot work with this engine, or None."""
    if pool is None or not isinstance(kv, KVCacheManager):
        return f"they need the paged KV cache, not kv_cache={cfg.kv_cache}"
    if not cfg.enable_prefix_caching:
        return "they need prefix caching (drop --no-enable-prefix-caching)"
    if cfg.tensor_parallel_size > 1:
        return "each tensor-parallel rank holds its own share of every block (not supported yet)"
    return None


def model_identity(loaded: LoadedModel, cfg: EngineConfig, pool: PagedKVCache) -> dict[str, Any]:
    """What fixes the bytes of a KV block, as JSON-ready data (the disk tier's key)."""
    path = loaded.path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    num_layers, _, _, num_kv_heads, head_dim = pool.cache.shape
    ops = loaded.ops
    return {
        "model": str(path),
        "files": [[f.name, st.st_size, st.st_mtime_ns, st.st_ino] for f in files if (st := f.stat())],
        "dtype": str(pool.dtype),
        "storage": str(pool.storage),
        "quantized_rows": kv_quant.ROW_FORMAT if pool.storage in kv_quant.QUANTIZED else None,
        "layout": {"layers": num_layers, "kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": pool.block_size},
        "device": pool.device.type,
        "kernels": [type(ops).__name__, getattr(getattr(ops, "module", None), "__name__", None)],
        "linears": dict(sorted(loaded.kernels.items())),
        "settings": {k: getattr(cfg, k) for k in _SETTINGS},
    }


def _disk_tier(cfg: EngineConfig, identity: dict[str, Any], block_nbytes: int) -> DiskTier | None:
    if cfg.prefix_cache_dir is None:
        return None
    text = json.dumps(identity, sort_keys=True, indent=1)
    digest = hashlib.sha256(text.encode()).digest()
    capacity = int(cfg.prefix_cache_disk_gb * 2**30)
    try:
        disk = DiskTier(Path(cfg.prefix_cache_dir).expanduser(), digest, block_nbytes, capacity)
    except OSError as e:
        log.warning("prefix cache: --prefix-cache-dir %s cannot be used (%s); going on without the disk tier",
                    cfg.prefix_cache_dir, e)  # fmt: skip
        return None
    with contextlib.suppress(OSError):  # for a person reading the folder: whose blocks these are
        (disk.folder / "identity.json").write_text(text)
    return disk
