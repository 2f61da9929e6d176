"""The inline row editor the tenants and tiers pages share: show the form in place of a row,
save it through ``edits.set_fields``, and answer with the row again or the form with errors.

Each page keeps what differs: which fields, how they parse, and where a schema problem's
path puts its message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flask import abort, redirect, request, url_for
from werkzeug.wrappers import Response

from console import edits
from console.security import is_htmx
from console.validation import PathProblem
from console.views.common import actor, reason_field, region, sluice

Errors = dict[str, list[str]]


@dataclass(frozen=True)
class RowEditor:
    scope: str  # "tenant" or "tier": edits.set_fields' scope, and the noun of a 404
    index: str  # the page's endpoint, where a form saved without HTMX redirects to
    page: str
    row_template: str
    form_template: str
    rows: Callable[[], list[dict[str, Any]]]
    context: Callable[..., dict[str, Any]]

    def find_row(self, name: str) -> dict[str, Any]:
        for row in self.rows():
            if row["name"] == name:
                return row
        abort(404, description=f"no {self.scope} {name!r}")

    def row(self, name: str, **extra: Any) -> tuple[str, int]:
        return region(self.page, self.row_template, **self.context(row=self.find_row(name), **extra))

    def form(self, name: str, row: dict[str, Any], form: dict[str, str], errors: Errors | None = None,
             status: int = 200) -> tuple[str, int]:
        errors = errors or {}
        return region(self.page, self.form_template, status,
                      **self.context(row=row, form=form, errors=errors,
                                     editing={name: {"form": form, "errors": errors}}))

    def save(self, name: str, row: dict[str, Any], form: dict[str, str], values: dict[str, Any], errors: Errors,
             problem_errors: Callable[[list[PathProblem]], Errors]) -> Response | tuple[str, int]:
        """Store ``values`` unless parsing the form found ``errors`` or the reason is missing.

        ``problem_errors`` puts the schema's objections to the edited policy next to the fields.
        """
        reason, problem = reason_field()
        form["reason"] = reason
        if problem:
            errors["reason"] = [problem]
        if not errors:
            result = edits.set_fields(sluice().state, actor=actor(), scope=self.scope, target=name, values=values,
                                      reason=reason)
            if result.ok:
                if not is_htmx():
                    return redirect(url_for(self.index), code=303)
                return self.row(name, saved=bool(result.changed))
            errors = problem_errors(result.problems)
        return self.form(name, row, form, errors, 422)


def posted(fields: Iterable[str]) -> dict[str, str]:
    return {f: (request.form.get(f) or "").strip() for f in fields}
