-- A speedtest-like SQL workload for the profile's cost on sqlite3 (in memory):
-- bulk inserts, an index, grouping, sorting, a join, updates and deletes.
PRAGMA cache_size = -65536;
CREATE TABLE t1(a INTEGER, b INTEGER, c TEXT);
CREATE TABLE t2(a INTEGER PRIMARY KEY, b INTEGER, c TEXT);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
INSERT INTO t1 SELECT i, (i * 7919) % 100003, printf('row %d %x %.*c', i, (i * 2654435761) % 4294967296, 8 + i % 200, 'x') FROM n;
INSERT INTO t2 SELECT a, b, substr(c, 1, 40) FROM t1 WHERE a % 3 = 0;
CREATE INDEX i1b ON t1(b);
CREATE INDEX i1c ON t1(c);
SELECT count(*), sum(length(c)) FROM t1 WHERE b BETWEEN 1000 AND 60000;
SELECT b % 1000 AS k, count(*), max(c) FROM t1 GROUP BY k ORDER BY 3 DESC LIMIT 3;
SELECT count(*) FROM t1 JOIN t2 ON t1.b = t2.b;
SELECT group_concat(c, ',') IS NOT NULL FROM (SELECT c FROM t1 ORDER BY c LIMIT 20000);
UPDATE t1 SET c = c || 'x' WHERE a % 5 = 0;
DELETE FROM t1 WHERE a % 7 = 0;
SELECT count(*), sum(length(c)) FROM t1;
