"""`tokenmill serve --prefix-cache-dir`: a prompt whose blocks the small pool evicted comes back from disk with the
same text, the hits show in /metrics and /stats by tier, and a restarted server over the same folder loads the
prompt's blocks from disk."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import Server, running
from tests.unit.test_cli import assert_one_line_error, run_cli

_RNG = random.Random(11)
PREFIX = [_RNG.randrange(3, 380) for _ in range(41)]
FILLERS = [[_RNG.randrange(3, 380) for _ in range(40)] for _ in range(2)]


def _complete(server: Server, prompt: list[int]) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _tier_hits(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.labels["tier"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "tokenmill:prefix_cache_hits_by_tier_total"}  # fmt: skip


def test_disk_hits_show_by_tier_and_survive_a_restart(checkpoint: Path, tmp_path: Path) -> None:
    flags = ("--block-size", "4", "--num-kv-blocks", "14", "--prefix-cache-dir", str(tmp_path / "blocks"),
             "--prefix-cache-disk-gb", "0.01")  # fmt: skip
    with running(checkpoint, tmp_path, *flags) as server:
        first = _complete(server, PREFIX)
        for filler in FILLERS:  # they push the prefix's blocks out of the pool, to disk (no RAM tier)
            _complete(server, filler)
        assert _complete(server, PREFIX) == first
        hits = _tier_hits(server)
        assert hits["disk"] > 0 and hits["ram"] == 0 and hits["pool"] + hits["disk"] == 40
        stats = httpx.get(f"{server.url}/stats", timeout=10).json()
        assert stats["prefix_cache_hits_by_tier"] == hits
        assert stats["prefix_cache_tier_bytes"]["disk"] > 0
    with running(checkpoint, tmp_path, *flags) as restarted:
        assert _complete(restarted, PREFIX) == first
        assert _tier_hits(restarted) == {"pool": 0, "ram": 0, "disk": 40}


def test_prefix_cache_flags_bad_values_and_an_unusable_folder(checkpoint: Path, tmp_path: Path) -> None:
    assert_one_line_error(run_cli("generate", str(checkpoint), "--prompt", "x", "--prefix-cache-ram-gb", "-1"),
                          "prefix_cache_ram_gb=-1.0", ">= 0")  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_cli("generate", str(checkpoint), "--prompt", "x", "--max-tokens", "3", "--json",
                   "--prefix-cache-dir", str(blocker / "blocks"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "prefix cache" in line]
    assert len(warnings) == 1 and "cannot be used" in warnings[0] and "without the disk tier" in warnings[0]
