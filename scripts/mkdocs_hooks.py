"""mkdocs hooks (mkdocs.yml `hooks:`): publish the repository files the pages link to.

Pages under docs/ link to a few files outside docs/ as GitHub resolves them
(`../benchmarks/results/emulated.md`, `../examples/01_optimize_your_model.ipynb`).
The site gets those files at the same place relative to the site's root
(`benchmarks/results/emulated.md` becomes a page, images, CSV files and notebooks are
copied as they are), and such links are rewritten to them, so that
`mkdocs build --strict` checks these links as it checks links between pages. A link out
of docs/ to any other file stays a broken link, which the strict build refuses.
"""
from __future__ import annotations

import pathlib
import posixpath
import re

from mkdocs.structure.files import File

# Folders (relative to the repository root) whose files the site publishes.
PUBLISHED = ("benchmarks/results", "examples")
SUFFIXES = (".md", ".png", ".csv", ".ipynb")

_LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")


def _root(config) -> pathlib.Path:
    return pathlib.Path(config.config_file_path).resolve().parent


def on_files(files, config):
    """Adds the published repository files to the site's files."""
    root = _root(config)
    for folder in PUBLISHED:
        for path in sorted((root / folder).glob("*")):
            if path.is_file() and path.suffix in SUFFIXES:
                files.append(File(path.relative_to(root).as_posix(), src_dir=str(root),
                                  dest_dir=config.site_dir,
                                  use_directory_urls=config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    """Rewrites links that leave docs/ for a published file to that file in the site."""
    root = _root(config)
    docs = pathlib.Path(config.docs_dir).resolve()
    if not page.file.abs_src_path or root not in pathlib.Path(page.file.abs_src_path).parents:
        return markdown
    if docs not in pathlib.Path(page.file.abs_src_path).parents:
        return markdown  # a published file itself: its links are relative to the repository
    page_dir = posixpath.dirname(page.file.src_uri)
    docs_in_repo = docs.relative_to(root).as_posix()

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repo = posixpath.normpath(posixpath.join(docs_in_repo, page_dir, target))
        if not any(in_repo.startswith(folder + "/") for folder in PUBLISHED):
            return match.group(0)
        relative = posixpath.relpath(in_repo, page_dir or ".")
        return match.group(1) + relative + match.group(3)

    return _LINK.sub(rewrite, markdown)
