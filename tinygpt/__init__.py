"""What the four scripts stand on: each module one job behind well-named calls.

The story is in model.py, prepare.py, train.py and sample.py; this package holds the how.
The other commands run from here: python -m tinygpt.score, python -m tinygpt.plot,
python bench/ladder.py.
"""
