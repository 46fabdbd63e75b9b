"""MkDocs hook: the docstrings' Sphinx roles (``:class:`dearopt.planning.Plan```, ``:func:`~x.y```) shown as code.

mkdocstrings renders docstrings as Markdown with the site's Markdown extensions; this adds one that rewrites a role
to a code span before the text is parsed. Loaded by ``hooks:`` in mkdocs.yml (no package, no network).
"""

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


class _Roles(Preprocessor):
    def run(self, lines):
        return [_ROLE.sub(r"`\1`", line) for line in lines]


class RolesExtension(Extension):
    """Rewrite Sphinx roles to code spans."""

    def extendMarkdown(self, md):  # noqa: N802 (Markdown's name)
        md.preprocessors.register(_Roles(md), "sphinx_roles", 30)


def on_config(config, **kwargs):
    config.markdown_extensions.append(RolesExtension())
    return config
