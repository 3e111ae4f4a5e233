"""pytoniq-core as an independent oracle: imq cells rebuilt as pytoniq cells."""

from __future__ import annotations

from pytoniq_core import Builder as PBuilder
from pytoniq_core import Cell as PCell

from imq.state.cells import Cell


def to_pytoniq(cell: Cell, memo: dict[bytes, PCell] | None = None) -> PCell:
    """The same cell tree built by pytoniq-core (exotic cells keep their type byte)."""
    memo = {} if memo is None else memo
    if cell.hash not in memo:
        builder = PBuilder()
        if cell.bits:
            builder.store_uint(int.from_bytes(cell.data) >> (-cell.bits % 8), cell.bits)
        refs = [to_pytoniq(ref, memo) for ref in cell.refs]
        memo[cell.hash] = PCell(builder.bits, refs, cell.data[0] if cell.exotic else -1)
    return memo[cell.hash]
