"""What ARL's observability output looks like to the ecosystem's own readers.

    observability.py metrics TARGETS_JSON   scrapes each {service: url} with urllib and
        parses it with prometheus_client's strict OpenMetrics parser; prints
        {service: {family: type}}; exits 1 naming the service whose text does not parse.
    observability.py tensorboard LOGDIR     reads every run folder with TensorBoard's
        EventAccumulator; prints {run: {tag: [[step, value], ...]}}.

Run with the observability venv's Python (`make observability`).
"""

import json
import os
import sys
import urllib.request


def metrics(targets_file):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with open(targets_file) as f:
        targets = json.load(f)
    found = {}
    for service, url in sorted(targets.items()):
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as err:  # the parser raises ValueError and friends
            print(f"{service} ({url}): not valid OpenMetrics text: {err}", file=sys.stderr)
            sys.exit(1)
        found[service] = {family.name: family.type for family in families}
    return found


def tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for run in sorted(os.listdir(logdir)):
        accumulator = EventAccumulator(os.path.join(logdir, run), size_guidance={"scalars": 0})
        accumulator.Reload()
        runs[run] = {
            tag: [[e.step, e.value] for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]
        }
    return runs


if __name__ == "__main__":
    command, path = sys.argv[1], sys.argv[2]
    result = {"metrics": metrics, "tensorboard": tensorboard}[command](path)
    print(json.dumps(result))
