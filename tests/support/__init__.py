"""What the tests share and is not a test: helpers, case tables, and
``workers/``, the scripts run in processes of their own. Imported as the
package ``support`` (``pythonpath`` in pyproject.toml).
"""
