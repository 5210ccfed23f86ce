"""Deep search: retrieval QA over a local corpus (``SearchQAEnv`` in ``envs.searchqa.env``)."""
