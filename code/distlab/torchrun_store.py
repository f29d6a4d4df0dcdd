"""Restart-safe rendezvous in torchrun's agent store: one fresh namespace per attempt.

Contract: :func:`agent_store_namespace` returns a namespace of the store that no earlier attempt of
the job used, the same on every rank of this attempt, and the number of earlier attempts.

Why (``torchrun --max-restarts N``): torchrun's agent serves one TCP store at
``MASTER_ADDR:MASTER_PORT`` for its whole life, and since PyTorch 2.5 the workers of every attempt
share it without a per-attempt prefix (pytorch/pytorch#135712, #135957). A restarted worker then
reads the keys its killed predecessors left there (gloo's addresses of processes that no longer
exist): ``init_process_group`` fails with "Connection refused", or waits until the group's
timeout, printing nothing. ``distlab.distributed.init_distributed`` therefore starts each
attempt's group in a fresh namespace of that store, named by rank 0 of the attempt and confirmed
by every other rank, and counts the attempts there (``DistContext.restart``).
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist


def agent_store_serves(launcher: str, master_addr: str, master_port: int) -> bool:
    """Whether torchrun's agent serves the rendezvous store at ``master_addr:master_port`` (it says
    so in ``TORCHELASTIC_USE_AGENT_STORE``, for its own ``MASTER_ADDR:MASTER_PORT`` only)."""
    return (
        launcher == "torchrun"
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == master_addr
        and os.environ.get("MASTER_PORT") == str(master_port)
    )


def _wait_keys(store: dist.Store, keys: list[str], deadline: float, what: str) -> None:
    """``store.wait(keys)`` until ``deadline`` (monotonic); past it, a TimeoutError naming ``what``."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise dist.DistStoreError("deadline passed")
        store.wait(keys, datetime.timedelta(seconds=left))
    except dist.DistStoreError:
        raise TimeoutError(what) from None


def agent_store_namespace(
    store: dist.Store, rank: int, world_size: int, timeout_s: float, where: str = "in torchrun's store"
) -> tuple[str, int]:
    """Agree with every rank of this attempt on a namespace of torchrun's store that no earlier
    attempt used; return it and the number of earlier attempts (rank 0's count, shared).

    Rank 0 counts its start (``starts``), draws a token ``<attempt>.<random>`` and publishes it as
    ``leader``. Every other rank answers the token it reads with a random word of its own
    (``<token>/ack/<rank>``) and takes the token once rank 0 echoes that word back
    (``<token>/go/<rank>``). A ``leader`` left by a killed attempt is never echoed with a word of
    this attempt, so a rank that read it reads again until rank 0 of this attempt has written
    its own. Every wait ends after ``timeout_s`` with a TimeoutError that names what it waited for.
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        attempt = store.add("starts", 1) - 1
        token = f"{attempt}.{uuid.uuid4().hex}"
        store.set("leader", token)
        acks = [f"{token}/ack/{r}" for r in range(1, world_size)]
        if acks:
            try:
                _wait_keys(store, acks, deadline, "")
            except TimeoutError:
                missing = [r for r, key in enumerate(acks, start=1) if not store.check([key])]
                raise TimeoutError(
                    f"rank 0 waited {timeout_s:.0f} s {where} for ranks {missing} to join attempt "
                    f"{attempt} of this torchrun job: are they alive, and started by the same torchrun?"
                ) from None
            store.multi_set([f"{token}/go/{r}" for r in range(1, world_size)], store.multi_get(acks))
        return token, attempt
    word, answered = uuid.uuid4().hex.encode(), None
    _wait_keys(
        store, ["leader"], deadline, f"rank {rank} waited {timeout_s:.0f} s {where} for rank 0 to start"
    )
    while True:  # "leader" stays once written: poll it
        token = store.get("leader").decode()
        if token != answered:
            store.set(f"{token}/ack/{rank}", word)
            answered = token
        go = f"{token}/go/{rank}"
        if store.check([go]) and store.get(go) == word:
            return token, int(token.split(".")[0])
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} waited {timeout_s:.0f} s {where} for rank 0 of this attempt: the last "
                f"leader it read, {token}, never answered (left by an attempt that was killed?)"
            )
        time.sleep(0.05)
