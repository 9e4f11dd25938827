"""The error of a request the engine cannot take, naming the input at fault (the HTTP API reports
it as a 400 with that `param`). A module of its own, importing nothing, so that what the sampling
parameters import (the structured-output spec) can raise one too: request.py imports those."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take (empty prompt, ids outside the vocabulary, too long, a
    structured-output spec it cannot generate); `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
