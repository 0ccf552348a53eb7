# Golden cases of ken.sql.rewrite.rewrite (checked by tests/test_golden.py).
#
# Each case: a "# title:" line, the input query (ending with ";"), then what the rewrite gives:
# the rewritten SQL (rw.sql, ending with ";") and one "--" line per call site: its label, the
# function, the SQL of its column arguments, its constants and the clauses it appears in.
# Semantic functions are the deterministic stand-ins of tests/test_golden.py: sentiment(text),
# sem_filter(text, 'predicate'), sem_match(a, b).
#
# To add a case, append a title and an input query, then regenerate the expected output:
#   KEN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_golden.py

# title: SELECT call
SELECT id, sentiment(text) AS mood FROM tweets;

# title: WHERE under AND, OR and NOT
SELECT id FROM tweets WHERE len > 40 AND (sem_filter(text, 'complains about a delayed flight') OR NOT sem_filter(text, 'is about food'));

# title: JOIN ON with a two-column call and a relational condition
SELECT a.id, b.id FROM abt a JOIN buy b ON a.id + 100 <= b.id AND sem_match(a.name, b.name);

# title: GROUP BY a semantic output
SELECT sentiment(text) AS mood, count(*) AS n FROM tweets GROUP BY sentiment(text);

# title: GROUP BY the alias of a semantic output
SELECT sentiment(text) AS mood, count(*) AS n FROM tweets GROUP BY mood ORDER BY n DESC;

# title: HAVING
SELECT label, count(*) AS n FROM tweets GROUP BY label HAVING max(sentiment(text)) = 'positive';

# title: ORDER BY
SELECT id, text FROM tweets ORDER BY sentiment(text), id;

# title: subquery in FROM
SELECT id FROM (SELECT id, sentiment(text) AS mood FROM tweets) AS s WHERE mood = 'positive';

# title: subquery in WHERE
SELECT id FROM tweets WHERE id IN (SELECT id FROM tweets WHERE sem_filter(text, 'is about food'));

# title: CTE with a semantic join
WITH a AS (SELECT * FROM abt WHERE name LIKE '%sony%')
SELECT a.name, b.name FROM a JOIN buy b ON sem_match(a.name, b.name);

# title: semantic call inside a CTE
WITH moods AS (SELECT id, sentiment(text) AS mood FROM tweets) SELECT mood, count(*) FROM moods GROUP BY mood;

# title: constant-argument call
SELECT id FROM tweets WHERE sem_filter(text, 'is about food');

# title: different constants are different sites
SELECT id, sem_filter(text, 'is about food') AS food FROM tweets WHERE sem_filter(text, 'complains about a delayed flight');

# title: a constant with a quote
SELECT id FROM tweets WHERE sem_filter(text, 'says it''s late');

# title: the same call twice is one site
SELECT sentiment(text) AS a FROM tweets WHERE sentiment(text) <> 'neutral';

# title: dedup of f(t.x) and f(x)
SELECT sentiment(t.text) AS a, sentiment(text) AS b FROM tweets AS t;

# title: upper-case function name
SELECT SENTIMENT(text) FROM tweets;

# title: no semantic call
SELECT id, upper(text) AS shout FROM tweets WHERE len > 100 ORDER BY id LIMIT 5;
