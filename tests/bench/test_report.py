"""Raw results as JSON: indented, with lists of numbers kept on one line."""

import json

from kamado.bench.report import results_json


def test_lists_of_numbers_take_one_line_and_the_json_reads_back_the_same():
    record = {
        "steps": [[102, 94.6, -3e-05], [103, 1e20, -0.0]],
        "names": ["step", "ratio"],
        "mixed": [1, True],
        "empty": [],
        # A string that looks like a list of numbers is left as it is.
        "command": "kamado bench [1,\n 2]",
    }
    text = results_json(record)
    assert json.loads(text) == record
    assert "[102, 94.6, -3e-05]" in text and "[103, 1e+20, -0.0]" in text
    assert '"step",\n' in text and "true\n" in text  # other lists keep a line per value
    assert text.endswith("}\n")
