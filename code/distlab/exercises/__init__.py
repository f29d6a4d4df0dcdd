"""Exercises that learners write themselves, one module per exercise, each with its own check.

Those whose mechanism runs on several ranks, notebook 03's :mod:`~distlab.exercises.ddp_by_hand`
(gradients averaged by asynchronous bucketed all-reduces started from gradient hooks, against
torch's ``DistributedDataParallel``) and notebook 07's :mod:`~distlab.exercises.zero_one` (one
ZeRO-1 AdamW step, against torch's ``AdamW`` on one process, and the optimizer state each rank
keeps) and notebook 05's :mod:`~distlab.exercises.tp_by_hand` (the f and g operators and a
column- then row-parallel MLP, against the full MLP on one process), run the learner's file on gloo
ranks spawned on this machine, whatever the site (:mod:`~distlab.exercises.ranks`), and follow
:mod:`distlab.checks`' contract: ``[not yet]`` while the file still holds ``FIXME``,
:class:`~distlab.checks.ExerciseError` with a hint for a wrong answer, ``[ok] ...`` for a right one.

Notebook 05's other two run in the notebook's process: :mod:`~distlab.exercises.pipeline_order`
(the 1F1B order, replayed as a pipeline runs it) and :mod:`~distlab.exercises.hybrid_layout` (a
two-node TP x PP layout chosen from limits, judged from the run's log), as do notebook 09's
:mod:`~distlab.exercises.attention_merge`, notebook 11's :mod:`~distlab.exercises.llama_layout` and
notebook 12's :mod:`~distlab.exercises.flight_recorder_hang`.
"""
