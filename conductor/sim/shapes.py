"""Traces of chosen shapes, in Mooncake's JSONL format (`timestamp` ms, `input_length`,
`output_length`, `hash_ids`: one id per 512 tokens, shared ids = a shared prefix).

    python -m conductor.sim.shapes PRESET|- [--requests N] [--rate R] [--PARAM VALUE ...] --out PATH

A trace is sessions of turns. Each session opens on one of `roots` shared prefixes (a system
prompt, a tool set: `root_blocks` blocks deep; the root is picked with Zipf skew `root_skew`, so
a few roots fan out to most sessions), then adds its own tokens (lognormal, median `new_tokens`);
each later turn carries the session's previous prompt and answer as its prefix (when `history`)
and adds new tokens again. Sessions start as a renewal process whose gaps have the coefficient of
variation `burstiness` (1: Poisson; above 1: bursts, a gamma process), at `rate_rps` requests per
second overall; a session's turns follow each other after exponential think times of mean
`turn_gap_s`. Outputs are lognormal, median `output_tokens`.

Presets resemble the three traces Mooncake published (FAST '25; mean input / output tokens and
prefix-cache hit ratio with an infinite cache): `conversation` (12,035 / 343 / 0.37-0.40: one
one-block system prompt shared by all, multi-turn sessions), `toolagent` (8,596 / 182 / 0.59:
a few deep tool prefixes shared by many short requests, bursty), `synthetic` (15,325 / 149 /
0.65: many distinct long documents, each asked about a few times). `describe()` gives what a
generated trace has, to set beside those figures."""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, fields, replace

BLOCK = 512  # tokens per hash id (Mooncake's unit)


@dataclass(frozen=True)
class Shape:
    name: str = "custom"
    requests: int = 4000
    rate_rps: float = 3.5
    burstiness: float = 1.0  # coefficient of variation of the gaps between session starts
    roots: int = 1  # distinct shared prefixes
    root_blocks: int = 1  # their depth, in 512-token blocks
    root_skew: float = 0.0  # Zipf exponent choosing a root (0: uniform)
    session_turns: float = 1.0  # mean turns per session (geometric)
    turn_gap_s: float = 30.0  # mean think time between turns
    history: bool = True  # a later turn's prompt starts with the previous prompt and answer
    new_tokens: int = 2000  # median new prompt tokens per turn (lognormal)
    new_sigma: float = 1.0
    output_tokens: int = 300  # median output tokens (lognormal)
    output_sigma: float = 0.6
    max_input: int = 131072
    seed: int = 0

    def check(self) -> "Shape":
        for name in ("requests", "root_blocks", "roots", "new_tokens", "output_tokens", "max_input"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("rate_rps", "burstiness", "turn_gap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0")
        if self.session_turns < 1:
            raise ValueError("session_turns must be at least 1")
        if self.root_skew < 0 or self.new_sigma < 0 or self.output_sigma < 0:
            raise ValueError("root_skew, new_sigma and output_sigma must not be negative")
        return self


PRESETS = {
    "conversation": Shape("conversation", rate_rps=3.4, burstiness=1.5, roots=1, root_blocks=1, session_turns=1.5,
                          turn_gap_s=60.0, new_tokens=5000, new_sigma=1.0, output_tokens=330, output_sigma=0.5),
    "toolagent": Shape("toolagent", rate_rps=6.7, burstiness=2.5, roots=24, root_blocks=6, root_skew=1.1,
                       session_turns=1.6, turn_gap_s=5.0, new_tokens=1600, new_sigma=1.2, output_tokens=120,
                       output_sigma=0.9),
    "synthetic": Shape("synthetic", rate_rps=3.9, burstiness=0.5, roots=900, root_blocks=24, root_skew=0.0,
                       session_turns=1.0, history=False, new_tokens=1500, new_sigma=1.0, output_tokens=70,
                       output_sigma=1.2),
}


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, int(round(median * math.exp(rng.gauss(0.0, sigma)))))


def _gap(rng: random.Random, mean: float, cv: float) -> float:
    """A gamma-distributed gap with this mean and coefficient of variation."""
    k = 1.0 / (cv * cv)
    return rng.gammavariate(k, mean / k)


def generate(shape: Shape) -> list[dict]:
    """Rows in arrival order (`timestamp` from 0, whole milliseconds)."""
    shape.check()
    rng = random.Random(shape.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    roots = [fresh(shape.root_blocks) for _ in range(shape.roots)]
    weights = [1.0 / (k + 1) ** shape.root_skew for k in range(shape.roots)]
    sessions_rate = shape.rate_rps / shape.session_turns
    stop_after = 1.0 / shape.session_turns  # geometric turns with this mean
    rows: list[tuple[float, int, int, list[int]]] = []
    t = 0.0
    while len(rows) < shape.requests:
        t += _gap(rng, 1.0 / sessions_rate, shape.burstiness)
        root = rng.choices(range(shape.roots), weights)[0]
        ids, length, at = list(roots[root]), shape.root_blocks * BLOCK, t
        while len(rows) < shape.requests:
            new = _lognormal(rng, shape.new_tokens, shape.new_sigma)
            total = min(shape.max_input, length + new)
            # Whole blocks of the prefix keep their ids; the rest of the prompt is new.
            keep = min(len(ids), length // BLOCK, total // BLOCK)
            prompt_ids = ids[:keep] + fresh(math.ceil(total / BLOCK) - keep)
            output = _lognormal(rng, shape.output_tokens, shape.output_sigma)
            rows.append((at, total, output, prompt_ids))
            if rng.random() < stop_after or total >= shape.max_input:
                break
            if shape.history:
                ids, length = prompt_ids, total + output
            at += rng.expovariate(1.0 / shape.turn_gap_s)
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [{"timestamp": int((at - start) * 1000), "input_length": n, "output_length": m, "hash_ids": h}
            for at, n, m, h in rows]


def describe(rows: list[dict]) -> dict:
    """What a trace has: requests, span, mean input and output, the infinite-cache hit ratio."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        n = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            n += 1
        hit += min(n * BLOCK, r["input_length"])
        total += r["input_length"]
        seen.update(r["hash_ids"])
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0
    return {"requests": len(rows), "span_s": span, "rate_rps": len(rows) / span if span else None,
            "mean_input": total / len(rows) if rows else None,
            "mean_output": sum(r["output_length"] for r in rows) / len(rows) if rows else None,
            "infinite_cache_hit_ratio": hit / total if total else 0.0}


def write(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def shape_from(preset: str, overrides: dict) -> Shape:
    if preset != "-" and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}, or - for the defaults")
    base = PRESETS.get(preset, Shape())
    return replace(base, **{k: v for k, v in overrides.items() if v is not None}).check()


def main(argv: list[str] | None = None) -> int:
    from kvstore.cli_args import fail

    prog = "python -m conductor.sim.shapes"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("preset", help=f"{', '.join(PRESETS)}, or - (the defaults)")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    for f in fields(Shape):
        if f.name != "name":
            kind = {"bool": lambda v: v.lower() in ("1", "true", "yes"), "int": int, "float": float}[str(f.type)]
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None)
    args = p.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in fields(Shape) if f.name != "name"}
    try:
        shape = shape_from(args.preset, overrides)
        rows = generate(shape)
        write(rows, args.out)
    except (ValueError, OSError) as exc:
        fail(prog, str(exc))
    print(json.dumps({"shape": asdict(shape), **describe(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
