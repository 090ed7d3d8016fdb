"""`tokenmill bench serve --server-peers LABEL=URL,...`: the same workload against peer servers, side by side.

Each peer gets its own run folder (exactly as if `bench serve --url URL --server-label LABEL` were run), with the
same prompts, seed, concurrency and flags, one server at a time; then one table puts the online numbers together.
A peer's model name is the first id its `/v1/models` lists unless `LABEL=URL@MODEL` names it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.flops import fma_share


def parse_peers(spec: str | None) -> list[tuple[str, str, str | None]]:
    """`llama=http://h:8080,hf=http://h:8081@Qwen` -> [(label, url, model or None), ...]."""
    peers: list[tuple[str, str, str | None]] = []
    for item in (s.strip() for s in (spec or "").split(",")):
        if not item:
            continue
        label, eq, rest = item.partition("=")
        url, _, model = rest.partition("@")
        if not eq or not label or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server-peers {item!r}: expected LABEL=http://HOST:PORT[@MODEL]")
        peers.append((label, url.rstrip("/"), model or None))
    return peers


def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        cards = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json().get("data") or []
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"--server-peers: cannot list models at {url}/v1/models ({e})") from e
    if not cards:
        raise ValueError(f"--server-peers: {url}/v1/models lists no model; name one as LABEL=URL@MODEL")
    return str(cards[0]["id"])


def peer_args(args: argparse.Namespace, label: str, url: str, model: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "url": url, "server_label": label,
                                 "model": model or first_model(url, args.api_key)})  # fmt: skip


def side_by_side(run_dirs: list[Path], out_dir: Path) -> Path:
    """One markdown table over finished serve runs; written to OUT_DIR/serve-side-by-side-<time>.md."""
    lines = [
        "| server | workload | concurrency | ok/sent | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
        "| E2E p50 ms | model GFLOPS | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in run_dirs:
        m: dict[str, Any] = json.loads((d / "manifest.json").read_text())
        s: dict[str, Any] = json.loads((d / "summary" / "summary.json").read_text())
        c = m["config"]
        lines.append(
            f"| {c['server_label']} | {s['workload']} | {c.get('max_concurrency') or '-'} | "
            f"{s['requests_completed']}/{s['requests_sent']} | {s['output_throughput']:.1f} | "
            f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} | "
            f"{s['e2e_ms']['p50']:.0f} | {fma_share(s['flops']) if 'flops' in s else '-'} | {d.name} |"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"serve-side-by-side-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return path
