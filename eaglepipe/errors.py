"""The project's exceptions: raised at boundaries (params, captures, exports), with actionable messages."""


class EaglepipeError(Exception):
    """Base class of every error eaglepipe raises on purpose."""


class ParamsError(EaglepipeError):
    """params.yaml is invalid: the message names the key, the bad value and what is allowed."""


class ConventionError(EaglepipeError):
    """A layer-id translation is impossible or ambiguous (unknown engine/family/version, collapsed ids, ...)."""


class CaptureMismatch(EaglepipeError):
    """Captured features disagree with what was expected (sample id, expected vs got, and why)."""


class ExportError(EaglepipeError):
    """A draft cannot be exported as is (missing/unexpected/misshapen tensor, ids that do not round-trip)."""


class FeatureStoreError(EaglepipeError):
    """A feature shard is missing, truncated or damaged, or a sample cannot be trained as stored (names the file)."""


class TrainingError(EaglepipeError):
    """Training cannot go on as asked (non-finite input or loss, a sample longer than a batch): names the sample."""


class ServingUnavailable(EaglepipeError):
    """This engine cannot serve an EAGLE-3 draft on this machine (serve_eval records the reason, never a figure)."""


class InputMissing(EaglepipeError):
    """A stage's input path does not exist: names it and the stage that writes it."""


class DiskFull(EaglepipeError):
    """The file system filled up while a stage wrote: names the file, the bytes needed and free, what was kept."""
