"""The emulator's errors: each names what failed in one line, with the compiler's or the
sanitizer's own report attached where there is one."""


class EmulatorError(RuntimeError):
    """Something the emulator cannot do with this kernel or this machine."""


class CompilerMissing(EmulatorError):
    """No C++ compiler (or, for strict mode, no clang) on this machine."""


class CompileError(EmulatorError):
    """The kernel's source did not compile as C++ against the Metal shim (or strict mode's
    clang rejected it); `diagnostics` holds the compiler's messages."""

    def __init__(self, message: str, diagnostics: str = ""):
        super().__init__(message if not diagnostics else f"{message}\n{diagnostics}")
        self.diagnostics = diagnostics


class KernelFault(EmulatorError):
    """The kernel ran and did something wrong: a sanitizer report (out-of-bounds access,
    undefined behaviour, a data race), divergent control flow at a barrier or simd operation,
    a Metal limit exceeded, an output element never written. `report` is the evidence."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message if not report else f"{message}\n{report}")
        self.report = report
