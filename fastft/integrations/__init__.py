"""Integrations with other libraries; each is imported only when used (fastft does not depend on them)."""
