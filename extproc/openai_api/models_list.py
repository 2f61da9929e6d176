"""``GET /v1/models`` and ``GET /v1/models/{id}``, answered from the policy.

Pure. SDKs and UIs (the openai SDK's ``models.list()``, LangChain, Open WebUI) call
these before anything else; Sluice answers them itself, so no backend is asked and
the answer lists exactly the models the policy routes.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import unquote

from extproc.policy.schema import Policy, Tenant

PREFIX = "/v1/models"
# OpenAI's "created" is when a model was made; a policy has no such date, so the
# process start stands in (stable across calls, which is what clients compare).
CREATED = int(time.time())


def route(path: str) -> tuple[bool, str | None] | None:
    """(True, None) for the list, (False, id) for one model, None for other paths."""
    path = path.split("?", 1)[0]
    if path in (PREFIX, PREFIX + "/"):
        return True, None
    if path.startswith(PREFIX + "/"):
        # The SDK percent-encodes ids such as "org/model" (…/models/org%2Fmodel).
        return False, unquote(path[len(PREFIX) + 1:])
    return None


def visible_models(policy: Policy, tenant: Tenant) -> list[str]:
    """The models ``tenant`` may call: every model the policy routes, fallbacks included.

    Nothing in the policy restricts models by tier or tenant today; this is the one
    place to change when something does.
    """
    del tenant
    return [m.name for b in policy.backends for m in b.models]


def model_card(policy: Policy, name: str, created: int = CREATED) -> dict[str, Any]:
    _, model = policy.by_model[name]
    return {"id": name, "object": "model", "created": created, "owned_by": "sluice",
            "max_model_len": model.context_window}


def list_body(policy: Policy, tenant: Tenant, created: int = CREATED) -> bytes:
    data = [model_card(policy, name, created) for name in visible_models(policy, tenant)]
    return json.dumps({"object": "list", "data": data}, ensure_ascii=False).encode()


def retrieve_body(policy: Policy, tenant: Tenant, name: str, created: int = CREATED) -> bytes | None:
    """One model's card, or None when the tenant may not see it (answer 404)."""
    if name not in visible_models(policy, tenant):
        return None
    return json.dumps(model_card(policy, name, created), ensure_ascii=False).encode()
