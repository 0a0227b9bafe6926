"""``rollcall report``: an events file in, one picture and a text summary out.

- ``run``: reading the events file, and what the run adds up to (goodput,
  series, stalls);
- ``text``: the table and the summary lines;
- ``plot``: the picture (matplotlib);
- ``command``: the click command.
"""
