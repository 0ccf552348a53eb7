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
SELECT id, __KEN_S0_SENTIMENT(text) AS mood FROM tweets;
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: WHERE under AND, OR and NOT
SELECT id FROM tweets WHERE len > 40 AND (sem_filter(text, 'complains about a delayed flight') OR NOT sem_filter(text, 'is about food'));
SELECT id FROM tweets WHERE len > 40 AND (__KEN_S0_SEM_FILTER(text) OR NOT __KEN_S1_SEM_FILTER(text));
-- s0: sem_filter args=["text"] constants=["complains about a delayed flight"] clauses=["WHERE"]
-- s1: sem_filter args=["text"] constants=["is about food"] clauses=["WHERE"]

# title: JOIN ON with a two-column call and a relational condition
SELECT a.id, b.id FROM abt a JOIN buy b ON a.id + 100 <= b.id AND sem_match(a.name, b.name);
SELECT a.id, b.id FROM abt AS a JOIN buy AS b ON a.id + 100 <= b.id AND __KEN_S0_SEM_MATCH(a.name, b.name);
-- s0: sem_match args=["a.name", "b.name"] constants=[] clauses=["JOIN ON"]

# title: GROUP BY a semantic output
SELECT sentiment(text) AS mood, count(*) AS n FROM tweets GROUP BY sentiment(text);
SELECT __KEN_S0_SENTIMENT(text) AS mood, COUNT(*) AS n FROM tweets GROUP BY __KEN_S0_SENTIMENT(text);
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT", "GROUP BY"]

# title: GROUP BY the alias of a semantic output
SELECT sentiment(text) AS mood, count(*) AS n FROM tweets GROUP BY mood ORDER BY n DESC;
SELECT __KEN_S0_SENTIMENT(text) AS mood, COUNT(*) AS n FROM tweets GROUP BY mood ORDER BY n DESC;
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: HAVING
SELECT label, count(*) AS n FROM tweets GROUP BY label HAVING max(sentiment(text)) = 'positive';
SELECT label, COUNT(*) AS n FROM tweets GROUP BY label HAVING MAX(__KEN_S0_SENTIMENT(text)) = 'positive';
-- s0: sentiment args=["text"] constants=[] clauses=["HAVING"]

# title: HAVING with an aggregate FILTER
# note: the site's clause is WHERE (the FILTER's), though the call is inside HAVING
SELECT label FROM tweets GROUP BY label HAVING count(*) FILTER (WHERE sem_filter(text, 'is about food')) > 0;
SELECT label FROM tweets GROUP BY label HAVING COUNT(*) FILTER(WHERE __KEN_S0_SEM_FILTER(text)) > 0;
-- s0: sem_filter args=["text"] constants=["is about food"] clauses=["WHERE"]

# title: ORDER BY
SELECT id, text FROM tweets ORDER BY sentiment(text), id;
SELECT id, text FROM tweets ORDER BY __KEN_S0_SENTIMENT(text), id;
-- s0: sentiment args=["text"] constants=[] clauses=["ORDER BY"]

# title: subquery in FROM
SELECT id FROM (SELECT id, sentiment(text) AS mood FROM tweets) AS s WHERE mood = 'positive';
SELECT id FROM (SELECT id, __KEN_S0_SENTIMENT(text) AS mood FROM tweets) AS s WHERE mood = 'positive';
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: subquery in WHERE
SELECT id FROM tweets WHERE id IN (SELECT id FROM tweets WHERE sem_filter(text, 'is about food'));
SELECT id FROM tweets WHERE id IN (SELECT id FROM tweets WHERE __KEN_S0_SEM_FILTER(text));
-- s0: sem_filter args=["text"] constants=["is about food"] clauses=["WHERE"]

# title: CTE with a semantic join
WITH a AS (SELECT * FROM abt WHERE name LIKE '%sony%')
SELECT a.name, b.name FROM a JOIN buy b ON sem_match(a.name, b.name);
WITH a AS (SELECT * FROM abt WHERE name LIKE '%sony%') SELECT a.name, b.name FROM a JOIN buy AS b ON __KEN_S0_SEM_MATCH(a.name, b.name);
-- s0: sem_match args=["a.name", "b.name"] constants=[] clauses=["JOIN ON"]

# title: semantic call inside a CTE
WITH moods AS (SELECT id, sentiment(text) AS mood FROM tweets) SELECT mood, count(*) FROM moods GROUP BY mood;
WITH moods AS (SELECT id, __KEN_S0_SENTIMENT(text) AS mood FROM tweets) SELECT mood, COUNT(*) FROM moods GROUP BY mood;
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: constant-argument call
SELECT id FROM tweets WHERE sem_filter(text, 'is about food');
SELECT id FROM tweets WHERE __KEN_S0_SEM_FILTER(text);
-- s0: sem_filter args=["text"] constants=["is about food"] clauses=["WHERE"]

# title: different constants are different sites
SELECT id, sem_filter(text, 'is about food') AS food FROM tweets WHERE sem_filter(text, 'complains about a delayed flight');
SELECT id, __KEN_S0_SEM_FILTER(text) AS food FROM tweets WHERE __KEN_S1_SEM_FILTER(text);
-- s0: sem_filter args=["text"] constants=["is about food"] clauses=["SELECT"]
-- s1: sem_filter args=["text"] constants=["complains about a delayed flight"] clauses=["WHERE"]

# title: a constant with a quote
SELECT id FROM tweets WHERE sem_filter(text, 'says it''s late');
SELECT id FROM tweets WHERE __KEN_S0_SEM_FILTER(text);
-- s0: sem_filter args=["text"] constants=["says it's late"] clauses=["WHERE"]

# title: the same call twice is one site
SELECT sentiment(text) AS a FROM tweets WHERE sentiment(text) <> 'neutral';
SELECT __KEN_S0_SENTIMENT(text) AS a FROM tweets WHERE __KEN_S0_SENTIMENT(text) <> 'neutral';
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT", "WHERE"]

# title: dedup of f(t.x) and f(x)
SELECT sentiment(t.text) AS a, sentiment(text) AS b FROM tweets AS t;
SELECT __KEN_S0_SENTIMENT(t.text) AS a, __KEN_S1_SENTIMENT(text) AS b FROM tweets AS t;
-- s0: sentiment args=["t.text"] constants=[] clauses=["SELECT"]
-- s1: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: upper-case function name
SELECT SENTIMENT(text) FROM tweets;
SELECT __KEN_S0_SENTIMENT(text) FROM tweets;
-- s0: sentiment args=["text"] constants=[] clauses=["SELECT"]

# title: no semantic call
SELECT id, upper(text) AS shout FROM tweets WHERE len > 100 ORDER BY id LIMIT 5;
SELECT id, UPPER(text) AS shout FROM tweets WHERE len > 100 ORDER BY id LIMIT 5;
-- no semantic calls
