"""Screenshots of every built docs page, and what overflows in them.

Usage (after building the HTML docs; needs Chromium, e.g. ``apt-get install
chromium``)::

  python docs/screenshots.py                   # docs/_build/html, 1400 and 800 px
  python docs/screenshots.py --widths 1400 --out /tmp/shots

For each page and width it writes ``OUT/<page>@<width>.png`` (the whole
page, trailing blank space cropped) and reports every code block, table or
output cell whose content is wider than its box (clipped, or scrolled
sideways): the report is measured in the browser by a script injected into
a copy of the page, so it needs no eyes to find a regression. Exit status 1
when something overflows. CI does not run it; run it after changing the
docs or how the package prints.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SKIP = {'genindex.html', 'search.html', 'py-modindex.html'}
HEIGHT = 12000

# Marks the elements whose content is wider than their box; Sphinx's and the
# theme's own scrollable containers count, as a reader has to scroll them.
_PROBE = """
<script>
window.addEventListener('load', () => {
  const found = [];
  const selector = 'pre, table, .cell_output, .output, .highlight, .mermaid';
  for (const el of document.querySelectorAll(selector)) {
    if (el.closest('.bd-sidebar-primary, .bd-sidebar-secondary, nav')) continue;
    if (el.scrollWidth > el.clientWidth + 1) {
      found.push({
        tag: el.tagName.toLowerCase(),
        cls: el.className.toString().slice(0, 40),
        text: el.innerText.slice(0, 60).replace(/\\s+/g, ' '),
        over: el.scrollWidth - el.clientWidth,
      });
    }
  }
  const out = document.createElement('pre');
  out.id = 'overflow-report';
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>
"""


def _chromium() -> str:
  for name in ('chromium', 'chromium-browser', 'google-chrome'):
    path = shutil.which(name)
    if path:
      return path
  sys.exit('error: no Chromium found; install it (apt-get install chromium)')


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(
    args, capture_output=True, text=True, timeout=timeout, check=False
  )


def _flags(width: int) -> list[str]:
  return [
    '--headless=new',
    '--no-sandbox',
    '--disable-gpu',
    '--hide-scrollbars',
    f'--window-size={width},{HEIGHT}',
    '--virtual-time-budget=8000',
  ]


def _crop(png: pathlib.Path) -> None:
  """Removes the blank space below the page's content."""
  from PIL import Image, ImageChops

  image = Image.open(png).convert('RGB')
  background = Image.new(
    'RGB', image.size, image.getpixel((0, image.height - 1))
  )
  box = ImageChops.difference(image, background).getbbox()
  if box:
    image.crop((0, 0, image.width, min(image.height, box[3] + 40))).save(png)


def overflows(chromium: str, page: pathlib.Path, width: int) -> list[dict]:
  """What overflows on `page` at `width` px, measured in the browser."""
  with tempfile.NamedTemporaryFile(
    'w', suffix='.html', dir=page.parent, delete=False
  ) as f:
    text = page.read_text()
    f.write(text.replace('</body>', _PROBE + '</body>'))
    probe = pathlib.Path(f.name)
  try:
    dom = _run([chromium, *_flags(width), '--dump-dom', probe.as_uri()]).stdout
  finally:
    probe.unlink()
  m = re.search(r'<pre id="overflow-report"[^>]*>(.*?)</pre>', dom, re.S)
  if m is None:
    return [{'tag': 'page', 'text': 'the probe did not run', 'over': -1}]
  import html

  return json.loads(html.unescape(m.group(1)))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--html', type=pathlib.Path, default=HERE / '_build' / 'html'
  )
  parser.add_argument(
    '--out', type=pathlib.Path, default=HERE / '_build' / 'screenshots'
  )
  parser.add_argument('--widths', type=int, nargs='+', default=[1400, 800])
  args = parser.parse_args()
  chromium = _chromium()
  pages = sorted(
    p
    for p in args.html.rglob('*.html')
    if p.name not in SKIP
    and not p.relative_to(args.html).parts[0].startswith('_')
  )
  if not pages:
    sys.exit(f'error: no HTML pages in {args.html}; build the docs first')
  args.out.mkdir(parents=True, exist_ok=True)
  problems = 0
  for page in pages:
    name = str(page.relative_to(args.html).with_suffix('')).replace('/', '_')
    for width in args.widths:
      png = args.out / f'{name}@{width}.png'
      _run([chromium, *_flags(width), f'--screenshot={png}', page.as_uri()])
      if png.exists():
        _crop(png)
      found = overflows(chromium, page, width)
      problems += len(found)
      status = 'ok' if not found else f'{len(found)} overflowing'
      print(f'{name:40} {width:5} px  {status}')
      for item in found:
        print(
          f'    {item["tag"]}.{item.get("cls", "")}: +{item["over"]} px: '
          f'{item["text"]!r}'
        )
  print(f'screenshots in {args.out}')
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main())
