"""A two-turn conversation through the token proxy with the official `openai` SDK, keeping
its history like an agent does; the first turn non-streaming, the second streaming.

usage: proxy_sdk.py BASE_URL MODEL   (the trial's base URL, key in the path; the model's
own name, which the models list must hold)
Prints the answers as JSON.
"""
import json
import sys

import openai


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
    model = sys.argv[2]
    listed = [m.id for m in client.models.list()]
    if model not in listed:
        sys.exit(f"{model!r} is not among the models listed: {listed}")
    messages = [{"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Name another one."}]
    second = ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            second += c.delta.content or ""
    print(json.dumps({"answers": [answer, second]}))


if __name__ == "__main__":
    main()
