"""Run a pytest-style test file where pytest is not installed (minimal images, host sandboxes).

Calls every top-level `test_*` function that takes no arguments, in file order, and
exits 0 only when at least one ran and none failed. Copied next to the task's tests so
a task's verifier needs nothing but python3; pytest itself is used whenever it exists.
Usage: python3 pytest_lite.py TEST_FILE
"""

import importlib.util
import inspect
import sys
import traceback


def main(path: str) -> int:
    spec = importlib.util.spec_from_file_location("tmax_test_module", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        traceback.print_exc()
        print(f"ERROR collecting {path}")
        return 2
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and inspect.isfunction(f)]
    failed = 0
    for name, fn in tests:
        if inspect.signature(fn).parameters:
            print(f"ERROR {name}: needs pytest fixtures, which this runner does not provide")
            failed += 1
            continue
        try:
            fn()
            print(f"PASSED {name}")
        except Exception as e:
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    return 0 if tests and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
