"""Context parallelism: the sequence split over cp ranks, attention by ring attention (Megatron Core's
``context_parallel`` attention, in Transformer Engine's ``attention``)."""
