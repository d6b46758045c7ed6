"""The page template: one self-contained HTML file (inline CSS, figures as data: URIs, no scripts, nothing fetched)."""
from __future__ import annotations

INDEX_HTML = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<link rel="icon" href="data:,">
<title>{{ title }}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.88em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; vertical-align: top; white-space: nowrap; }
table.left td { white-space: normal; }
.scroll { overflow-x: auto; max-width: 100%; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
table.left td, table.left th { text-align: left; }
.worstgrid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 0 1em; }
.note { color: #555; font-size: 0.88em; }
.warning { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.6em 1em; margin: 1em 0; }
.pass { background: #e8f5e9; } .fail { background: #ffebee; } .error { background: #fff3e0; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.88em; }
.worst { border: 1px solid #ddd; border-radius: 4px; padding: 0.5em 0.8em; margin: 0.6em 0; }
.worst .meta { font-size: 0.85em; color: #555; }
.ctx { font-family: ui-monospace, "DejaVu Sans Mono", monospace; white-space: pre-wrap; background: #fafafa; padding: 0.4em; margin: 0.3em 0; }
.ctx mark { background: #ffcc80; outline: 1px solid #e65100; }
.tops { display: flex; gap: 2em; font-size: 0.85em; } .tops ol { margin: 0.2em 0; padding-left: 1.6em; }
code { background: #f4f4f4; padding: 0 0.2em; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<p class="note">KL is KL(reference ‖ pack) in nats over scored positions, computed over the full vocabulary by <code>fidelity compare</code>.
Confidence intervals are 95% bootstrap intervals over panel rows.</p>
{% for w in warnings %}<div class="warning"><strong>Warning:</strong> {{ w }}</div>
{% endfor %}
{% macro table(t, level=3) %}
{% if t %}<h{{ level }}>{{ t.title }}</h{{ level }}>
<div class="scroll"><table{% if t.classes %} class="{{ t.classes|join(' ') }}"{% endif %}><thead><tr>{% for h in t.headers %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for r in t.rows %}<tr>{% for c in r %}<td{% if loop.index0 in t.status_columns %} class="{{ status_class(c) }}"{% endif %}>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</tbody></table></div>
{% if t.note %}<p class="note">{{ t.note }}</p>{% endif %}{% endif %}
{% endmacro %}
{% macro figure(f) %}<figure><img src="data:image/png;base64,{{ f.base64 }}" alt="{{ f.caption }}" width="{{ f.width }}" height="{{ f.height }}">
<figcaption>{{ f.caption }} (<code>{{ f.name }}</code>)</figcaption></figure>{% endmacro %}
{% for g in groups %}
<h2 id="group-{{ loop.index }}">{{ g.heading }}</h2>
{% if g.warning %}<div class="warning"><strong>Warning:</strong> {{ g.warning }}</div>{% endif %}
{{ table(g.overall) }}
{{ table(g.tails) }}
{{ table(g.likelihood) }}
{% for f in g.figures_top %}{{ figure(f) }}{% endfor %}
{% for t in g.domain_tables %}{{ table(t) }}{% endfor %}
{{ table(g.paired) }}
{{ table(g.paired_domains) }}
{% for f in g.figures_records %}{{ figure(f) }}{% endfor %}
{{ table(g.quantiles) }}
{{ table(g.confidence) }}
{% for n in g.notes %}<p class="note">{{ n }}</p>{% endfor %}
{% if g.worst %}<h3>Worst positions (highest KL)</h3>
<p class="note">The highlighted token is the one being predicted at that position; the lists are the reference's and the pack's most likely
tokens there, with probabilities.</p>
<div class="worstgrid">
{% for w in g.worst %}<div class="worst"><div class="meta">{{ w.label }} · row <code>{{ w.row_id }}</code> · {{ w.domain }} ·
position {{ w.position }} · KL {{ num(w.kl) }}</div>
<div class="ctx">{{ w.before }}<mark>{{ w.token }}</mark>{{ w.after }}</div>
<div class="tops"><div>reference<ol>{% for t, p in w.reference_top %}<li><code>{{ t }}</code>{% if p is not none %} {{ "%.3f"|format(p) }}{% endif %}</li>{% endfor %}</ol></div>
{% if w.pack_top %}<div>{{ w.label }}<ol>{% for t, p in w.pack_top %}<li><code>{{ t }}</code>{% if p is not none %} {{ "%.3f"|format(p) }}{% endif %}</li>{% endfor %}</ol></div>{% endif %}
</div></div>
{% endfor %}</div>{% endif %}
{% for t in g.worst_rows %}{{ table(t) }}{% endfor %}
{% endfor %}
{% for a in attributions %}<h2>{{ a.heading }}</h2>
{% for t in a.tables %}{{ table(t) }}{% endfor %}
{% for f in a.figures %}{{ figure(f) }}{% endfor %}
{% endfor %}
{{ table(suites, 2) }}
{% if gates %}{{ table(gates, 2) }}{% for t in gate_worst %}{{ table(t) }}{% endfor %}{% endif %}
{% for t in speed %}{{ table(t, 2) }}{% endfor %}
{{ table(provenance, 2) }}
</body>
</html>
"""  # noqa: E501 (the page template, kept byte for byte: long lines are the HTML it emits)
