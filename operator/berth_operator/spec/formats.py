"""Kubernetes' own string formats (apimachinery validation), as regular expressions."""

from __future__ import annotations

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A host name an Ingress may serve: a DNS subdomain, or one with a leading wildcard label.
WILDCARD_DNS1123_SUBDOMAIN = r"^(\*\.)?" + DNS1123_SUBDOMAIN[1:]
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-a-zA-Z0-9_.]+$"
# A C identifier-ish env var name, as `kubectl` accepts them.
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
