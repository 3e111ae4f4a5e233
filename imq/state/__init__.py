"""The persistent queue state format of the network (tycho's ``block.queueState``).

This package owns the file format alone, and knows nothing of the database:

- ``source``: raw or zstd input as a stream of exact reads, counting offsets;
- ``tl``: the TL codec of queue diffs and state headers, and the BLAKE3 diff hash;
- ``boc``: cells, their representation hash, and BOC decoding and encoding;
- ``message``: the internal-message header parser and a message builder;
- ``reader``: a state file as a checked stream of (diff, message roots) segments;
- ``writer``: a state file from diffs and message BOCs, chunked with the true count;
- ``block``: the top update ``(diff hash, tail length)`` of a tycho block.

``imq.state.importer`` and ``imq.state.exporter`` connect the format to the store.
"""
