"""`tapetrain compare`: the same evaluations, with the same data, seeds and protocol, for every model of a
comparison, in one report with confidence intervals.

    entries.py   what a MODEL argument is: a run directory, an export, or a group of seed runs (NAME/seed-S/)
    suites.py    the evaluations (ppl, needle, ruler): settings, computing one result, its numbers per length
    cache.py     results on disk, reused while their settings are unchanged
    summary.py   per-length values with bootstrap intervals (and mean ± spread over seed runs), paired differences
                 from the first model with the verdict they support
    report.py    summary.json, README.md (a table per evaluation and its paired differences)
    plots.py     PPL vs length, needle heatmaps side by side, RULER score vs length, training loss
    command.py   the command itself
"""
