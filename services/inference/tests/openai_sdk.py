"""Drives the inference server with the official `openai` SDK; prints what it saw as JSON.

usage: openai_sdk.py BASE_URL
"""
import json
import sys

import openai


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
    out = {}
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    kwargs = dict(model="policy", messages=messages, temperature=0.8, seed=7,
                  max_tokens=24, logprobs=True, top_logprobs=2)

    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    out["whole"] = {
        "content": choice.message.content,
        "token_ids": choice.model_extra["token_ids"],
        "logprobs": [t.logprob for t in choice.logprobs.content],
        "top": [[a.logprob for a in t.top_logprobs] for t in choice.logprobs.content],
        "prompt_token_ids": whole.model_extra["prompt_token_ids"],
        "policy_version": whole.model_extra["policy_version"],
        "usage": whole.usage.model_dump(),
        "finish_reason": choice.finish_reason,
    }

    streamed = {"content": "", "token_ids": [], "logprobs": [], "finish_reason": None}
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    for chunk in stream:
        if chunk.usage is not None:
            streamed["usage"] = chunk.usage.model_dump()
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            streamed["token_ids"] += c.model_extra.get("token_ids", [])
            if c.logprobs is not None:
                streamed["logprobs"] += [t.logprob for t in c.logprobs.content]
            if c.finish_reason is not None:
                streamed["finish_reason"] = c.finish_reason
    out["streamed"] = streamed

    completion = client.completions.create(model="policy", prompt=out["whole"]["prompt_token_ids"],
                                           max_tokens=5, temperature=0)
    out["completion"] = {"text": completion.choices[0].text,
                         "token_ids": completion.choices[0].model_extra["token_ids"]}

    out["models"] = [m.id for m in client.models.list().data]

    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi " * 5000}])
        out["too_long"] = None
    except openai.BadRequestError as e:
        out["too_long"] = {"status": e.status_code, "code": e.code}

    try:
        client.chat.completions.create(model="policy", messages=messages, temperature=7)
        out["bad_temperature"] = None
    except openai.BadRequestError as e:
        out["bad_temperature"] = {"status": e.status_code, "message": e.message}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
