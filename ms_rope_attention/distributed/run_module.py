"""``python run_module.py MODULE [args]``: runs MODULE as ``python -m MODULE [args]`` would. msrun
launches a script path, not ``-m``; the launcher's ``-m`` passes this file and the module."""
import runpy
import sys

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
