"""A 3-D parallel job for people, one rule for the dashboard, `scalemon snapshot` and `scalemon
summary`: each rank's place in the device mesh ("pp0 dp1 tp0"), ranks grouped by a mesh axis,
the pipeline's bubble measured against its schedule's, the MoE imbalance, the point-to-point
rows ("send 0 -> 2") and the wait-for chains with the op on each edge ("2 -recv-> 1 -recv->
0 (in Python: train.py:40 in step())"). Pure: JSON-ready data in (`snapshot --json`'s keys),
text out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from scalemon.collectives import P2P_OPS
from scalemon.text.display import NA

"""The `op` of a point-to-point row of the collectives table."""


# --- the mesh --------------------------------------------------------------------------------

def mesh_coords(value: Any) -> dict[str, int] | None:
    """A rank's mesh coordinates {"pp": 0, "dp": 1} from what carries them: a coords dict
    (`snapshot --json`'s per-rank "mesh") or an info "mesh" value ({"coords": {...}, ...});
    None when there are none (or they are not name -> int)."""
    if isinstance(value, Mapping) and "coords" in value:
        value = value["coords"]
    if not isinstance(value, Mapping) or not value:
        return None
    coords = {str(k): v for k, v in value.items()
              if isinstance(v, int) and not isinstance(v, bool)}
    return coords or None


def mesh_dims(coords: Iterable[Mapping[str, int] | None]) -> list[str]:
    """The mesh's axes in the order the ranks name them (the mesh's own: outermost first)."""
    dims: list[str] = []
    for c in coords:
        for dim in c or ():
            if dim not in dims:
                dims.append(dim)
    return dims


def mesh_text(coords: Mapping[str, int] | None, dims: list[str]) -> str:
    """"pp0 dp1 tp0": a rank's coordinates along `dims`; "n/a" without any."""
    if not coords:
        return NA
    return " ".join(f"{d}{coords[d]}" for d in dims if d in coords) or NA


def mesh_width(coords: Iterable[Mapping[str, int] | None], dims: list[str]) -> int:
    """The widest `mesh_text` of the ranks (at least the heading's "mesh")."""
    return max([len("mesh"), *(len(mesh_text(c, dims)) for c in coords)])


def grouped(ranks: Iterable[int], coords: Mapping[int, Mapping[str, int] | None],
            axis: str) -> list[tuple[int | None, list[int]]]:
    """The ranks grouped by their coordinate along `axis`, groups in coordinate order (ranks
    without one last, as None), ranks in order within each."""
    groups: dict[int | None, list[int]] = {}
    for rank in sorted(ranks):
        c = coords.get(rank)
        groups.setdefault(c.get(axis) if c else None, []).append(rank)
    return sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))


def group_heading(axis: str, value: int | None, ranks: list[int]) -> str:
    """"tp 0: 4 ranks" over the rows of one value of the axis grouped by."""
    what = f"{axis} {value}" if value is not None else f"no {axis}"
    return f"{what}: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"


def unknown_axis_text(axis: str, dims: list[str]) -> str:
    """Why a table cannot be grouped by `axis`, naming the axes there are."""
    if not dims:
        return f"no mesh axis {axis!r}: no rank reported a device mesh"
    return f"no mesh axis {axis!r}: the mesh has {', '.join(dims)}"


# --- the pipeline and MoE --------------------------------------------------------------------

def _pct(value: Any) -> str:
    return f"{value * 100:.0f}%" if _finite(value) else NA


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def pipeline_line(p: Mapping[str, Any] | None) -> str | None:
    """"pipeline 1f1b, 2 stages x 4 microbatches: bubble measured 31% (median), theory 20%"
    from `snapshot --json`'s "pipeline"; None without a pipeline."""
    if not p:
        return None
    schedule = p.get("schedule")
    stages, micro = p.get("stages"), p.get("microbatches")
    measured, theory = p.get("measured_bubble"), p.get("theoretical_bubble")
    if schedule is None and stages is None:  # P2P measured, the schedule never described
        return (f"pipeline bubble measured {_pct(measured)}"
                f"{' (median)' if _finite(measured) else ''}; no theory: the script did not "
                "describe its schedule (scalemon.agent.describe_pipeline)")
    shape = f"{NA if stages is None else stages} stages x " \
            f"{NA if micro is None else micro} microbatches"
    virtual = p.get("virtual_stages")
    if virtual and virtual > 1:  # 1: one stage per rank, as every other schedule
        shape += f" ({virtual} virtual stages per rank)"
    schedule = schedule or "(schedule not described)"
    return (f"pipeline {schedule}, {shape}: bubble measured {_pct(measured)}"
            f"{' (median)' if _finite(measured) else ''}, theory {_pct(theory)}")


def moe_line(m: Mapping[str, Any] | None) -> str | None:
    """"all_to_all recv imbalance 1.40x, router imbalance 1.30x, dropped 12 tokens in the
    latest step" from `snapshot --json`'s "moe" (each rank's latest step; the dropped tokens
    summed over the ranks); None without MoE figures."""
    if not m:
        return None

    def times(value: Any) -> str:
        return f"{value:.2f}x" if _finite(value) else NA

    dropped = m.get("dropped_tokens")
    return (f"all_to_all recv imbalance {times(m.get('a2a_recv_imbalance'))}, router "
            f"imbalance {times(m.get('imbalance'))}, dropped "
            f"{NA if dropped is None else f'{dropped:.0f}'} tokens in the latest step")


# --- point to point --------------------------------------------------------------------------

def is_p2p(row: Mapping[str, Any]) -> bool:
    """True for a point-to-point row of the collectives table (`op` send/recv with src/dst)."""
    return row.get("op") in P2P_OPS and "src" in row and "dst" in row


def p2p_name(row: Mapping[str, Any]) -> str:
    """"send 0 -> 2" (global ranks)."""
    return f"{row['op']} {row['src']} -> {row['dst']}"


def nbytes(value: Any) -> str:
    """Bytes in binary units: 29.3 GiB."""
    if not _finite(value):
        return NA
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            break
        amount /= 1024
    return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"


def ms(seconds: Any) -> str:
    """A duration in ms, 3 significant digits."""
    if not _finite(seconds):
        return NA
    value = seconds * 1e3
    return f"{value:.0f} ms" if value >= 1000 else f"{value:.3g} ms"


def bandwidth(bytes_per_s: Any) -> str:
    """A bandwidth in GB/s (1 GB = 1e9 B), 3 significant digits."""
    if not _finite(bytes_per_s):
        return NA
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def p2p_cells(row: Mapping[str, Any]) -> tuple[str, ...]:
    """("send 0 -> 2", group, count, bytes, time, bandwidth) of a P2P row."""
    return (p2p_name(row), str(row.get("group") or ""), str(row.get("count", NA)),
            nbytes(row.get("bytes")), ms(row.get("time_s")),
            bandwidth(row.get("bandwidth_bytes_per_s")))


def p2p_text(row: Mapping[str, Any]) -> str:
    """"send 0 -> 2 (pp [0,2]): 12 x, 1.5 MiB, 3.2 ms, 0.47 GB/s"."""
    name, group, count, size, time_s, bw = p2p_cells(row)
    where = f" ({group})" if group else ""
    return f"{name}{where}: {count} x, {size}, {time_s}, {bw}"


# --- wait-for chains -------------------------------------------------------------------------

def chain_text(chain: list[int], hang: Mapping[str, Any]) -> str:
    """A wait-for chain with the op each rank waits in on its edge and the culprit's cause at
    the end: "2 -recv-> 1 -recv-> 0 (in Python: train.py:40 in step())"."""
    waits = {w["rank"]: w for w in hang.get("waits") or () if isinstance(w, Mapping)}
    causes = {c["rank"]: c for c in hang.get("causes") or () if isinstance(c, Mapping)}
    text = str(chain[0]) if chain else ""
    for a, b in zip(chain, chain[1:], strict=False):
        op = (waits.get(a) or {}).get("op")
        text += f" -{op}-> {b}" if op else f" -> {b}"
    end = causes.get(chain[-1]) if chain else None
    if end is not None and end.get("culprit", True):
        text += f" ({_cause_words(end)})"
    return text


def shown_chains(hang: Mapping[str, Any], most: int = 4) -> list[str]:
    """The hang's wait-for chains worth a line (`chain_text`): those through another rank,
    and those of a single point-to-point wait; at most `most`, then "(+N more)"."""
    waits = {w["rank"]: w for w in hang.get("waits") or () if isinstance(w, Mapping)}
    chains = [c for c in hang.get("chains") or () if len(c) > 2 or (
        len(c) == 2 and (waits.get(c[0]) or {}).get("op") in P2P_OPS)]
    lines = [chain_text(c, hang) for c in chains[:most]]
    if len(chains) > most:
        lines.append(f"(+{len(chains) - most} more)")
    return lines


def _cause_words(cause: Mapping[str, Any]) -> str:
    kind = cause.get("cause")
    if kind == "python":
        frame = cause.get("frame")
        return f"in Python: {frame}" if frame else "in Python"
    text = str(cause.get("text") or kind)
    return text.split(": ", 1)[1] if text.startswith("rank ") and ": " in text else text
