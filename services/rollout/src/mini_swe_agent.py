"""Runs mini-swe-agent (PyPI `mini-swe-agent`, unchanged, its text-based config) on one
task inside an ARL sandbox, against the token proxy. Started by the rollout service as
`/opt/arl-agents/bin/python -` with this program on stdin, in the task's work tree.

Environment: OPENAI_BASE_URL / OPENAI_API_KEY (the trial's proxy URL and key),
AGENT_TASK (the instruction), AGENT_STEP_LIMIT, AGENT_MAX_TOKENS, AGENT_TEMPERATURE.
The last line of output is a JSON object: {"exit_status": ..., "steps": ...}.
"""
import json
import os
import pathlib

# No network in a sandbox: litellm must use its bundled model table.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import yaml
import minisweagent
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel


def main() -> None:
    config_file = pathlib.Path(minisweagent.__file__).parent / "config/mini_textbased.yaml"
    config = yaml.safe_load(config_file.read_text())
    model_config = dict(config.get("model", {}))
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": os.environ["OPENAI_BASE_URL"],
        "api_key": os.environ["OPENAI_API_KEY"],
        "temperature": float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
        "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "512")),
    }
    model = LitellmTextbasedModel(model_name="openai/policy", cost_tracking="ignore_errors", **model_config)
    env = LocalEnvironment(cwd=os.getcwd(), **config.get("environment", {}))
    agent_config = {**config["agent"], "step_limit": int(os.environ.get("AGENT_STEP_LIMIT", "8")), "cost_limit": 0}
    agent = DefaultAgent(model, env, **agent_config)
    try:
        result = agent.run(os.environ["AGENT_TASK"])
        status = result.get("exit_status") if isinstance(result, dict) else str(result)
    except Exception as e:  # limits end a run with an exception in some versions
        status = type(e).__name__
    steps = sum(1 for m in agent.messages if m.get("role") == "assistant")
    print(json.dumps({"exit_status": status, "steps": steps}))


if __name__ == "__main__":
    main()
