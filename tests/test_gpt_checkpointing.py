"""Checkpoints: Megatron layout, a save killed half-way never becomes the latest, mismatches named;
a crash before any step of a save (both formats, a new iteration or a re-save, with and without
an atomic exchange of folders) leaves the tracker naming a loadable checkpoint, and a completed
save fsyncs what it names before naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import checkpoint_config
from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)


def _config(root: str, **kw) -> CheckpointConfig:
    shape = dict(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=8) | kw
    return checkpoint_config(PretrainArgs(save=root, load=root, **shape))


def _scenario(ctx: DistContext, root: str) -> None:
    rank = ctx.rank
    state = ParallelState.build(Layout(dist.get_world_size()))
    config = _config(root)
    model = GPTModel(GPTConfig(1, 16, 2, 32, 8, seed=rank), state)  # different on purpose: dp rank 0 saves
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).mean().backward()
    opt.step()
    checkpointing.save_checkpoint(
        config, state, Snapshot(model, opt, {"scale": 8.0}, iteration=1, consumed_samples=4)
    )
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    real_save = torch.save

    def dying_save(obj, f, *a, **k):  # the job is killed while writing the file (an open file)
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed during save")

    torch.save = dying_save
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointing.save_checkpoint(
                config, state, Snapshot(model, opt, None, iteration=2, consumed_samples=8)
            )
    finally:
        torch.save = real_save
    dist.barrier()
    result = {
        "tracker": checkpointing.read_tracker(root),
        "iter2": os.path.exists(f"{root}/iter_0000002"),
    }
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    iteration, consumed, scaler = checkpointing.load_checkpoint(config, state, model, opt)
    result.update(iteration=iteration, consumed=consumed, scaler=scaler)
    result["restored"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    try:
        checkpointing.load_checkpoint(_config(root, hidden_size=32), state, model, opt)
    except ValueError as exc:
        result["mismatch"] = str(exc)
    Path(root, f"result{rank}.json").write_text(json.dumps(result))


def test_killed_save_keeps_the_previous_checkpoint_latest(tmp_path):
    run_gloo(_scenario, 1, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000001", "iter_0000002.tmp"]
    assert (tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").exists()
    r = json.loads((tmp_path / "result0.json").read_text())  # the run after the "kill"
    assert r["tracker"] == 1 and not r["iter2"]
    assert (r["iteration"], r["consumed"], r["scaler"]) == (1, 4, {"scale": 8.0})
    assert r["restored"]
    assert "--hidden-size 16 (checkpoint) vs 32 (now)" in r["mismatch"]


def test_missing_folder_means_fresh_start(tmp_path):
    assert checkpointing.read_tracker(str(tmp_path / "none")) is None
    (tmp_path / checkpointing.TRACKER).write_text("oops")
    with pytest.raises(ValueError, match="holds 'oops'"):
        checkpointing.read_tracker(str(tmp_path))


class Crash(BaseException):
    """The process dies here: not an ``Exception``, so no handler on the way swallows it."""


class FileSystemSteps:
    """The save's steps on the file system (``os.replace``/``os.rename``, ``os.fsync``,
    ``shutil.rmtree``, ``durable.exchange``), recorded in order; with ``crash_at=k`` the process
    "dies" just before step k: that step and every later one raise :class:`Crash` (a real crash
    runs nothing after it; what it wrote before stays, as after a killed process)."""

    def __init__(self, crash_at: int | None = None, exchange: bool = True) -> None:
        self.crash_at, self.exchange, self.events, self.crashed = crash_at, exchange, [], False
        self.real = {"replace": os.replace, "rename": os.rename, "fsync": os.fsync}

    def _step(self, event: tuple) -> None:
        if self.crashed or len(self.events) == self.crash_at:
            self.crashed = True
            raise Crash(f"killed before step {len(self.events)}: {event}")
        self.events.append(event)

    def __enter__(self) -> FileSystemSteps:
        import shutil

        from distlab.gpt.checkpointing import durable

        real, rmtree, exchange = self.real, shutil.rmtree, durable.exchange

        def rename(kind):
            def fn(src, dst, *a, **k):
                parent = os.stat(os.path.dirname(os.path.abspath(dst))).st_ino  # whose entries change
                self._step(("rename", str(src), str(dst), parent))
                return real[kind](src, dst, *a, **k)

            return fn

        def fsync(fd):
            self._step(("fsync", os.fstat(fd).st_ino))
            return real["fsync"](fd)

        def remove(path, *a, **k):
            self._step(("rmtree", str(path)))
            return rmtree(path, *a, **k)

        def swap(a, b):
            self._step(("exchange", str(a), str(b)))
            return exchange(a, b) if self.exchange else False

        self.undo = [(os, "replace", os.replace), (os, "rename", os.rename), (os, "fsync", os.fsync),
                     (shutil, "rmtree", rmtree), (durable, "exchange", exchange)]  # fmt: skip
        os.replace, os.rename, os.fsync = rename("replace"), rename("rename"), fsync
        shutil.rmtree, durable.exchange = remove, swap
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in self.undo:
            setattr(module, name, fn)


def _durable_order(steps: FileSystemSteps, root: str, final: str) -> list[str]:
    """What a power loss could undo in a completed save: each checkpoint file and folder must be
    fsynced before the rename that names it, the folder's rename fsynced (the parent) before the
    tracker names it, the tracker fsynced before and after its replace, and nothing removed
    before then. The problems found."""
    ev, tracker = steps.events, os.path.join(root, checkpointing.TRACKER)
    synced = lambda ino, lo, hi: any(e == ("fsync", ino) for e in ev[lo:hi])  # noqa: E731
    # the step that put the folder in place: its rename, its exchange, or (exchange refused) the
    # rename after it
    publish = max(i for i, e in enumerate(ev) if e[0] in ("rename", "exchange") and e[2] == final)
    named = next(i for i, e in enumerate(ev) if e[0] == "rename" and e[2] == tracker)
    root_ino = os.stat(root).st_ino
    problems = []
    for folder, dirs, files in os.walk(final):
        children = {os.stat(os.path.join(folder, n)).st_ino for n in [*dirs, *files]}
        for name in files:
            if not synced(os.stat(os.path.join(folder, name)).st_ino, 0, publish):
                problems.append(f"{os.path.join(folder, name)} not fsynced before {ev[publish]}")
        ino = os.stat(folder).st_ino  # its entries: fsynced after its files were (created and) synced
        changed = [i for i, e in enumerate(ev[:publish]) if e[0] == "fsync" and e[1] in children]
        changed += [i for i, e in enumerate(ev[:publish]) if e[0] == "rename" and e[3] == ino]
        if not synced(ino, max(changed, default=0), publish):
            problems.append(f"{folder} not fsynced after its entries, before {ev[publish]}")
    if not synced(root_ino, publish, named):
        problems.append(f"{root} not fsynced between {ev[publish]} and the tracker's replace")
    if not synced(os.stat(tracker).st_ino, 0, named):
        problems.append("the tracker's temporary file is not fsynced before its replace")
    after = [i for i in range(named, len(ev)) if ev[i] == ("fsync", root_ino)]
    if not after:
        problems.append(f"{root} not fsynced after the tracker's replace")
    removed = [e for e in ev[publish:] if e[0] == "rmtree"]
    if removed and (not after or ev.index(removed[0], publish) < after[0]):
        problems.append(f"{removed[0]} before the tracker is durable")
    return problems


def _crash_worker(ctx: DistContext, root: str, fmt: str, out: str) -> None:
    """Saves iterations 1 (weights A) and 2 (B), then for each scenario (the next iteration 3; a
    re-save of iteration 2, the one the tracker names; the same where the file system refuses to
    exchange folders) saves C with a crash before each step in turn, then loads what the tracker
    names, then saves again (the restarted job) and loads. The findings, per scenario."""
    import shutil

    state = ParallelState.build(Layout(1))
    model = GPTModel(GPTConfig(1, 16, 2, 32, 8, seed=3), state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).mean().backward()
    opt.step()  # an optimizer state to save

    def weights(shift: float) -> dict:
        with torch.no_grad():
            for p, q in zip(model.parameters(), base, strict=True):
                p.copy_(q + shift)
        return {k: v.clone() for k, v in model.state_dict().items()}

    def save(where: str, iteration: int) -> None:
        save_fn = dist_checkpointing.save_checkpoint if fmt == "torch_dist" else checkpointing.save_checkpoint
        save_fn(_config(where, ckpt_format=fmt), state, Snapshot(model, opt, None, iteration, 4 * iteration))

    def loaded(where: str) -> tuple[int, str]:
        weights(100.0)
        load_fn = dist_checkpointing.load_checkpoint if fmt == "torch_dist" else checkpointing.load_checkpoint
        iteration = load_fn(_config(where, ckpt_format=fmt), state, model, opt)[0]
        now = model.state_dict()
        same = [name for name, w in states.items() if all(torch.equal(now[k], v) for k, v in w.items())]
        return iteration, "".join(same)

    from distlab.gpt.checkpointing import dist_checkpointing

    base = [p.detach().clone() for p in model.parameters()]
    states = {"A": weights(1.0), "B": weights(2.0), "C": weights(3.0)}
    template = os.path.join(root, "template")
    for iteration, name in ((1, "A"), (2, "B")):
        weights(float(ord(name) - 64))
        save(template, iteration)
    results = {}
    for scenario, iteration, exchange in (
        ("next", 3, True),
        ("resave", 2, True),
        ("resave-no-exchange", 2, False),
    ):
        found = {"crash points": 0, "after crash": [], "after restart": [], "leftovers": [], "order": []}
        for k in range(1000):
            where = os.path.join(root, f"{scenario}-{k}")
            shutil.copytree(template, where)
            weights(3.0)
            with FileSystemSteps(crash_at=k, exchange=exchange) as steps:
                try:
                    save(where, iteration)
                except BaseException:  # Crash, or DCP's CheckpointException wrapping it
                    if not steps.crashed:
                        raise
            if not steps.crashed:  # every step passed: the save is complete
                found["order"] = _durable_order(steps, where, checkpointing.checkpoint_dir(where, iteration))
                break
            found["crash points"] += 1
            found["after crash"].append(loaded(where))
            weights(3.0)
            save(where, iteration)  # the restarted job saves the same iteration again
            found["after restart"].append(loaded(where))
            found["leftovers"] += [n for n in os.listdir(where) if n.endswith((".tmp", ".old"))]
        found["complete"] = loaded(where)
        results[scenario] = found
    Path(out).write_text(json.dumps(results))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_crash_at_any_step_of_a_save_leaves_the_tracker_naming_a_loadable_checkpoint(tmp_path, fmt):
    """Killed before each of the save's renames, fsyncs and removals in turn, for the next
    iteration and for a re-save of the one the tracker names (with an atomic exchange of the
    folders and without): the tracker names a checkpoint that loads, the previous one or the new
    one, whole; the restarted job's save then completes and leaves no debris. A completed save
    fsyncs everything before naming it, and removes the previous folder only after."""
    out = tmp_path / "results.json"
    run_gloo(_crash_worker, 1, str(tmp_path), fmt, str(out), timeout_s=200)
    results = json.loads(out.read_text())
    for scenario, found in results.items():
        before, new = ("B", 2), ("C", 3 if scenario == "next" else 2)
        assert found["crash points"] >= 8, (scenario, found)  # renames, fsyncs, the tracker, removal
        for iteration, weights in found["after crash"]:
            assert (weights, iteration) in (before, new), f"{scenario}: loaded {weights!r} at {iteration}"
        assert {w for _, w in found["after crash"]} == {"B", "C"}, scenario  # the crash points span both
        assert found["after restart"] == [[new[1], "C"]] * found["crash points"], scenario
        assert found["complete"] == [new[1], "C"] and not found["leftovers"], (scenario, found)
        assert found["order"] == [], (scenario, found["order"])
