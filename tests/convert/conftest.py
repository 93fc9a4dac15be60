"""tests/convert's helpers (golden_artifacts, fake_hub, the engine ports) stay in this folder while
the tests mirror convert/'s rooms in sub-folders: pytest puts a conftest's folder on ``sys.path``
(rootdir-relative imports, no ``__init__.py``), so ``from golden_artifacts import …`` works from
every room."""
