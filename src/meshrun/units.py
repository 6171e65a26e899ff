"""How numbers read to a user: the one byte formatter and the one rank/index-list formatter of meshrun."""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: float) -> str:
    """1536 -> '1.5 KiB', 3 * 2**30 -> '3.0 GiB', 1000 -> '1000 B' (binary units, one decimal)."""
    for unit, scale in _UNITS:
        if abs(size) >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size:.0f} B"


def format_ranks(values: list[int]) -> str:
    """Sorted ranks (or layer indices) in the '0-3,8' style.

    Runs of three or more read 'a-b', shorter runs are listed: [0, 1, 2, 5, 7, 8] -> '0-2,5,7,8'. A stride of
    more than one over four or more values reads 'first,second,..,last': [0, 4, 8, 12] -> '0,4,..,12'."""
    if len(values) > 3 and values[1] - values[0] > 1 and all(
            b - a == values[1] - values[0] for a, b in zip(values, values[1:])):
        return f"{values[0]},{values[1]},..,{values[-1]}"
    spans: list[str] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            run = values[start:i]
            spans.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)))
            start = i
    return ",".join(spans)
