"""Communication between processes: point-to-point, collectives, a hand-written ring, bandwidth.

==============  ===================================================================
module          what it holds
==============  ===================================================================
launch          spawn-or-launcher start-up, the "not both" guard, rank-prefixed printing
p2p             blocking send/recv and non-blocking isend/irecv ring shifts
collectives     one demo per collective with its expected result; subgroups
ring            ``ring_all_reduce``: reduce-scatter + all-gather over send/recv
bench           nccl-tests arithmetic (algbw, busbw), timing sweep, CSV/JSON results
plot            bus bandwidth against message size from result files
diagrams        the before/after pictures in ``images/collectives/``
==============  ===================================================================
"""

from distlab.comm.bench import BUS_FACTOR, algbw, busbw
from distlab.comm.ring import ring_all_reduce

__all__ = ["BUS_FACTOR", "algbw", "busbw", "ring_all_reduce"]
