"""Reduced gradient buckets to new params: the update of stage 0 and of each ZeRO stage.

``base.py`` states the one interface every stage implements (``begin``, ``reduced``,
``verdict``, ``finish``), implements stage 0 and states each stage's rules once
(``Stage``: what it shards and so what it refuses); ``bucket_stats.py`` holds each bucket's
norm and finite flag; ``pieces.py`` the pieces of a sharded checkpoint each stage owns.
Stages 1-3 (slices of the optimizer state, the gradients and the params, and hybrid
sharding across nodes) live in ``zero/``. Import the modules themselves; the public names
are re-exported from ``fdp``.
"""
