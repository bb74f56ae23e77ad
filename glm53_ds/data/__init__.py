"""Training data as users hold it: every form `--data` takes (sources.py), the columns of a row source (columns.py)
and its tokenisation by several workers into one memory-mapped cache per file system (prepare.py);
`python -m glm53_ds.data prepare` builds that cache ahead of a run (__main__.py).

The training side (glm53_ds/training/data.py, packing.py, mixture.py) reads what is built here: windows over an
indexed dataset, or packed rows."""
