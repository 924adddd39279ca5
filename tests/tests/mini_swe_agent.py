"""mini-swe-agent (its text-based config, unchanged) driven through the token proxy.

usage: mini_swe_agent.py BASE_URL WORKDIR OUT.json   Writes the agent's messages as JSON.
"""
import json
import os
import pathlib
import sys

# No network here: litellm uses its bundled model table.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import yaml
import minisweagent
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel


def main() -> None:
    base_url, workdir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    config = yaml.safe_load((pathlib.Path(minisweagent.__file__).parent / "config/mini_textbased.yaml").read_text())
    model_config = dict(config.get("model", {}))
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": base_url,
        "api_key": "unused",
        "temperature": 0.0,
        "max_tokens": 64,
    }
    model = LitellmTextbasedModel(model_name="openai/policy", cost_tracking="ignore_errors", **model_config)
    env = LocalEnvironment(cwd=workdir, **config.get("environment", {}))
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": 3, "cost_limit": 0})
    try:
        result = agent.run("Create a file named hello.txt that contains the word hello.")
    except Exception as e:  # the step limit ends the run with an exception in some versions
        result = {"exit_status": type(e).__name__}
    pathlib.Path(out).write_text(json.dumps({"result": str(result), "messages": agent.messages}, default=str))


if __name__ == "__main__":
    main()
