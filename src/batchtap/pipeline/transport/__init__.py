"""How the training side's messages reach a :class:`~batchtap.pipeline.chain.core.PipelineCore`:
the pipeline thread, or the pipeline process (its link, its child loop, what crosses the pipe and
the shared-memory segments blocks travel in), and the choice between them."""
