"""Exercises that learners write themselves, one module per exercise, each with its own check.

Those whose mechanism runs on several ranks, notebook 03's :mod:`~distlab.exercises.ddp_by_hand`
(gradients averaged by asynchronous bucketed all-reduces started from gradient hooks, against
torch's ``DistributedDataParallel``) and notebook 07's :mod:`~distlab.exercises.zero_one` (one
ZeRO-1 AdamW step, against torch's ``AdamW`` on one process, and the optimizer state each rank
keeps), run the learner's file on gloo ranks spawned on this machine, whatever the site
(:mod:`~distlab.exercises.ranks`), and follow :mod:`distlab.checks`' contract: ``[not yet]`` while
the file still holds ``FIXME``, :class:`~distlab.checks.ExerciseError` with a hint for a wrong
answer, ``[ok] ...`` for a right one.
"""
