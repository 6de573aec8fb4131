def test_dedup():
    rows = open("/home/user/dedup.csv").read().splitlines()
    assert len(rows) == 4
