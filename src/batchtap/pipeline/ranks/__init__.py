"""Process-group facts (:mod:`~batchtap.pipeline.ranks.group`) and the rank agreement on stops and
verdicts (:mod:`~batchtap.pipeline.ranks.agreement`)."""
