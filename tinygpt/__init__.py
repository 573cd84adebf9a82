"""What the four scripts (model.py, prepare.py, train.py, sample.py) stand on: each module one job behind
well-named calls. Other commands run from here too: python -m tinygpt.score, tinygpt.plot, tinygpt.export."""
