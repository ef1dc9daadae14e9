"""moeplan: offline planning of expert placement and token routing for expert-parallel MoE.

Stages (one sub-package each, in data-flow order):

- ``planner.trace``        trace schema v1: reader, writer, synthetic generator, engine ingest
- ``planner.profile``      record how a Hugging Face MoE model routes real prompts
- ``planner.predict``      token->expert, n-gram device and load-distribution predictors
- ``planner.solve``        balanced token-expert co-clustering (CEO, ILP, METIS, ...)
- ``planner.export``       int16 bundles and serving-engine formats
- ``planner.runtime_shim`` torch/Triton code that applies a bundle online
"""

__version__ = "0.1.0"
