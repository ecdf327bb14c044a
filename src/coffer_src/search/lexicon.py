"""Search lexicon: stop words, equivalences, abbreviations, the multilingual lexicon."""

from __future__ import annotations

import re
import unicodedata

_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")


STOP_WORDS = frozenset("""
a about above after again all also am an and any are as at be been before being below between both but by can
could did do does doing down during each few for from further had has have having he her here hers him his how i
if in into is it its itself just let me more most my no nor not now of off on once only or other our ours out
over own please same she should so some such than that the their theirs them then there these they this those
through to too under until up very was we were what when where which while who whom why will with would you
your yours want need like using use via tool tools mcp server help could kindly
s t d m ll re ve don doesn didn isn aren wasn weren haven hasn hadn couldn shouldn wouldn
""".split())  # the last line: what is left of "what's", "don't", "I'd", "we've" once the apostrophe splits them

_IRREGULAR = {"children": "child", "people": "person", "men": "man", "women": "woman", "data": "data",
              "analyses": "analysis", "indices": "index", "media": "media", "news": "news", "status": "status",
              "bus": "bus", "gas": "gas", "alias": "alias", "canvas": "canvas", "https": "http"}


_EQUIVALENCES = """
create new add make generate insert build compose
delete remove drop erase destroy trash purge
list enumerate show browse all
search find query lookup look locate discover seek
send post notify message publish tell dm announce
fetch get read retrieve load obtain open view
update edit modify change patch set rename alter
screenshot capture snapshot screen
run execute exec invoke launch start trigger
stop kill terminate halt cancel abort
write save store put persist
upload attach
download save
file document doc
directory folder dir
issue ticket bug task
pull merge pr
email mail gmail inbox
chat conversation channel slack
web internet online website site page url link
image picture photo img
translate translation language
weather forecast temperature
time timezone clock date
calendar event meeting schedule appointment
repo repository project
user person member people account profile
navigate go visit browse
click press tap
remember memory recall note knowledge
sql database db table
convert transform export
summarize summary tldr digest
price cost quote
stock share ticker market
map location place address geocode direction route
video youtube movie
song music track playlist
deploy release ship
error exception crash failure
comment reply review
dialog popup modal
coordinates latitude longitude
elevation altitude height
"""
# Shorthand an agent writes for words a tool's description spells out ("open a PR" = pull request): in a query
# they also count as the full words, at TRANSLATION_WEIGHT.
_ABBREVIATIONS = """
pr=pull_request prs=pull_request mr=merge_request mrs=merge_request k8s=kubernetes gh=github
repo=repository repos=repository env=environment envs=environment config=configuration configs=configuration
cfg=configuration msg=message msgs=message db=database dbs=database dir=directory dirs=directory
docs=documentation auth=authentication info=information dm=direct_message dms=direct_message org=organization
orgs=organization pkg=package pkgs=package deps=dependency img=image imgs=image pic=picture pics=picture
vid=video vids=video addr=address stats=statistics tz=timezone calc=calculate txn=transaction
txns=transaction perf=performance prod=production dev=development
"""

EQUIVALENCE_WEIGHT = 0.35
TRANSLATION_WEIGHT = 0.8

# Common tool-domain words in other languages, mapped to English index terms.  CJK keys match as substrings.
_LEXICON = """
搜索=search 查找=find 查询=query 检索=search 天气=weather 文件=file 读取=read 创建=create 新建=create
删除=delete 发送=send 消息=message 邮件=email 翻译=translate 图片=image 图像=image 截图=screenshot
网页=web_page 网站=website 日历=calendar 时间=time 时区=timezone 股票=stock 股价=stock_price 价格=price
地图=map 地址=address 位置=location 问题=issue 仓库=repository 数据库=database 列出=list 列表=list
下载=download 上传=upload 运行=run 执行=execute 视频=video 音乐=music 笔记=note 任务=task 会议=meeting
提交=commit 代码=code 目录=directory 文件夹=folder 用户=user 评论=comment 合并=merge 分支=branch
总结=summarize 摘要=summary 转换=convert 生成=generate 图表=chart 新闻=news 热搜=trending 热门=trending
记忆=memory 浏览器=browser 点击=click 导航=navigate 链接=link 表格=table 文档=document 写入=write
保存=save 编辑=edit 修改=update 更新=update 获取=get 汇率=exchange_rate 货币=currency 航班=flight
酒店=hotel 天=day 排行=rank 论文=paper 数学=math 计算=calculate 音频=audio 语音=speech 识别=recognize
検索=search 天気=weather ファイル=file 作成=create 削除=delete 送信=send メッセージ=message メール=email
翻訳=translate 画像=image 写真=photo スクリーンショット=screenshot 予定=event カレンダー=calendar
時刻=time 時間=time 株価=stock_price 地図=map 一覧=list リポジトリ=repository データベース=database
読み込=read 読む=read 書き込=write 保存=save 更新=update 取得=get 課題=issue イシュー=issue 会議=meeting
ブラウザ=browser クリック=click ページ=page ニュース=news 動画=video 音楽=music 要約=summarize 変換=convert
buscar=search busca=search crear=create crea=create borrar=delete eliminar=delete elimina=delete enviar=send
envía=send envia=send mensaje=message correo=email archivo=file archivos=file fichero=file clima=weather
tiempo=weather traducir=translate traduce=translate imagen=image captura=screenshot calendario=calendar
evento=event reunión=meeting leer=read lee=read escribir=write escribe=write listar=list lista=list
precio=price acciones=stock carpeta=folder página=page pagina=page noticias=news tarea=task hora=time
suchen=search suche=search erstellen=create erstelle=create löschen=delete lösche=delete senden=send
sende=send nachricht=message datei=file dateien=file wetter=weather übersetzen=translate übersetze=translate
bild=image bildschirmfoto=screenshot kalender=calendar termin=event lesen=read lies=read schreiben=write
liste=list auflisten=list preis=price aktie=stock aktienkurs=stock_price ordner=folder seite=page
nachrichten=news aufgabe=task uhrzeit=time zeit=time besprechung=meeting
rechercher=search chercher=search cherche=search créer=create crée=create supprimer=delete supprime=delete
envoyer=send envoie=send fichier=file fichiers=file météo=weather traduire=translate traduis=translate
calendrier=calendar événement=event lire=read écrire=write lister=list prix=price dossier=folder
actualités=news tâche=task heure=time réunion=meeting courriel=email
ファイル一覧=file_list 現在=current 时刻=time 時刻=time 几点=time 现在=current 当前=current 最新=latest
最近=recent 状态=status 状態=status 差异=diff 差分=diff 分支=branch ブランチ=branch 扩容=scale 副本=replica
配当=dividend 分红=dividend 股息=dividend 详细=detail 详情=detail 詳細=detail 频道=channel チャンネル=channel
打开=open 開いて=open 开=open 按钮=button ボタン=button 页面=page 内容=content 表=table 提交记录=commit_log
日志=log ログ=log 作成して=create 読んで=read 表示=show 显示=show 查看=view 一覧を=list 取得して=get
数据=data 节点=node 命名空间=namespace 部署=deploy 容器=container 镜像=image 端口=port 转发=forward
aktuell=current aktuelle=current aktuellen=current aktueller=current jetzt=current gerade=current spät=time
uhr=time verzeichnis=directory verzeichnisse=directory baum=tree aktien=stock kurs=price kurse=price
informationen=information bildschirm=screen foto=photo
routen=route routenplanung=directions planung=plan dividende=dividend dividenden=dividend
historie=history verlauf=history anmelde=login anmeldung=login knopf=button schaltfläche=button
protokoll=log protokolle=log kanal=channel kanäle=channel adresse=address koordinaten=coordinates
projekt=project änderung=change änderungen=change zweig=branch
letzte=last letzten=latest neueste=latest neuigkeiten=news schlagzeilen=headlines neu=new neuen=new neuer=new
neues=new tabelle=table zeile=row spalte=column benutzer=user nutzer=user konto=account passwort=password
rechnung=invoice zahlung=payment bestellung=order kunde=customer kunden=customer kommentar=comment
kommentare=comment antwort=reply antworte=reply größe=size grösse=size inhalt=content inhalte=content
wiederherstellen=restore speichere=save speichern=save öffne=open öffnen=open verschiebe=move verschieben=move
umbenennen=rename benenne=rename kopiere=copy kopieren=copy vergleiche=compare vergleichen=compare
zusammenfassung=summary fasse=summarize erkläre=explain übersicht=overview abhängigkeiten=dependencies
datenbank=database abfrage=query tabellen=table zeitzone=timezone stadt=city wo=location entfernung=distance
höhe=elevation ort=place orte=place
アップロード=upload ダウンロード=download ディレクトリ=directory フォルダ=folder フォルダー=folder ツリー=tree
スケール=scale レプリカ=replica デプロイ=deploy コンテナ=container イメージ=image ポッド=pod ノード=node
ユーザー=user ユーザ=user アカウント=account パスワード=password プロジェクト=project タスク=task チケット=ticket
コメント=comment プルリクエスト=pull_request マージ=merge コミット=commit タグ=tag リリース=release ビルド=build
エラー=error バグ=bug ドキュメント=document テーブル=table クエリ=query スキーマ=schema レコード=record
スプレッドシート=spreadsheet シート=sheet グラフ=chart チャート=chart レポート=report リンク=link ウェブ=web
サイト=website タブ=tab フォーム=form テキスト=text ノート=note メモ=note メモリ=memory スレッド=thread イベント=event
スケジュール=schedule リマインダー=reminder タイムゾーン=timezone コード=code スクリプト=script コマンド=command
ターミナル=terminal プロセス=process サーバー=server サーバ=server ポート=port キャッシュ=cache
バックアップ=backup インストール=install パッケージ=package バージョン=version ステータス=status
ログイン=login トークン=token インボイス=invoice カスタマー=customer 天気予報=weather_forecast 価格=price
株式=stock 編集=edit 実行=run 返信=reply 移動=move 複製=copy コピー=copy 名前変更=rename
比較=compare 説明=explain 開く=open 追加=add 支払い=payment 請求書=invoice 顧客=customer 注文=order
파일=file 폴더=folder 디렉토리=directory 디렉터리=directory 트리=tree 검색=search 찾기=find 찾아=find
생성=create 만들=create 만드=create 삭제=delete 지워=delete 지우=delete 전송=send 보내=send 메시지=message 메일=email
번역=translate 이미지=image 사진=photo 스크린샷=screenshot 웹=web 페이지=page 캘린더=calendar 일정=event
시간=time 날씨=weather 주가=stock_price 주식=stock 가격=price 지도=map 주소=address 위치=location 이슈=issue
저장소=repository 리포지토리=repository 데이터베이스=database 목록=list 다운로드=download 업로드=upload
실행=run 동영상=video 음악=music 노트=note 메모=note 메모리=memory 작업=task 회의=meeting 커밋=commit 코드=code
사용자=user 댓글=comment 병합=merge 브랜치=branch 요약=summarize 변환=convert 차트=chart 뉴스=news
브라우저=browser 클릭=click 링크=link 테이블=table 문서=document 저장=save 편집=edit 수정=update
업데이트=update 조회=view 열어=open 열기=open 읽어=read 읽기=read 로그=log 채널=channel 버튼=button
배포=deploy 컨테이너=container 노드=node 포트=port 상태=status 현재=current 최신=latest 최근=recent
환율=exchange_rate 항공편=flight 호텔=hotel 결제=payment 청구서=invoice 고객=customer 주문=order
스케일=scale 복제본=replica 레플리카=replica
arquivo=file arquivos=file criar=create excluir=delete apagar=delete pesquisar=search procurar=search
previsão=forecast mensagem=message mensagens=message usuário=user repositório=repository baixar=download
tarefa=task tarefas=task reunião=meeting comentário=comment traduzir=translate imagem=image
endereço=address localização=location notícias=news preço=price planilha=spreadsheet resumir=summarize
cartella=folder cercare=search creare=create eliminare=delete
inviare=send invia=send messaggio=message messaggi=message utente=user immagine=image indirizzo=address
notizie=news prezzo=price riunione=meeting commento=comment tradurre=translate traduci=translate
scaricare=download scarica=download caricare=upload carica=upload riassumere=summarize riassumi=summarize
meteo=weather previsioni=forecast
"""


def _parse_lexicon(text: str) -> dict[str, tuple[str, ...]]:
    table = {}
    for pair in text.split():
        key, _, value = pair.partition("=")
        table[unicodedata.normalize("NFKC", key).lower()] = tuple(value.split("_"))
    return table



# German separable verbs: "Lade die Datei hoch" is hochladen (upload) with the particle at the clause's end.
# Listed as infinitives; translations() rejoins a particle with an inflected verb form anywhere in the query.
_SEPARABLE_VERBS = """
hochladen=upload herunterladen=download runterladen=download anlegen=create hinzufügen=add anzeigen=show
ansehen=view anschauen=view abrufen=fetch aufrufen=open umrechnen=convert umwandeln=convert auflisten=list
ausführen=run einfügen=insert eintragen=add zurücksetzen=reset einloggen=login anmelden=login abmelden=logout
aufnehmen=record abschicken=send absenden=send weiterleiten=forward zusammenfassen=summarize
nachschlagen=lookup nachsehen=check herausfinden=find zusammenführen=merge festlegen=set einstellen=set
abbrechen=cancel anhalten=stop ausschalten=disable einschalten=enable abspielen=play aufzeichnen=record
hochskalieren=scale_up herunterfahren=shutdown neustarten=restart zurückrollen=rollback zurückgehen=back
ausfüllen=fill auswählen=select anklicken=click weiterschicken=forward umbenennen=rename
"""
_GERMAN_PARTICLES = ("hoch", "herunter", "runter", "an", "ab", "auf", "aus", "ein", "hinzu", "um", "zu",
                     "zurück", "weiter", "nach", "heraus", "zusammen", "fest", "neu")
_GERMAN_PARTICLE_SET = frozenset(_GERMAN_PARTICLES)

LEXICON = _parse_lexicon(_LEXICON)
_LEXICON_ENDINGS = frozenset(key[-3:] for key in LEXICON if len(key) >= 3)  # a compound ends in a lexicon word
SEPARABLE_VERBS = _parse_lexicon(_SEPARABLE_VERBS)
# The CJK keys of the lexicon by their first two characters (a one-character key by its one): a text's CJK runs
# need testing only against the keys that start with one of their characters or character pairs.
_LEXICON_CJK: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
for _key, _english in LEXICON.items():
    if _CJK_RE.search(_key):
        _LEXICON_CJK.setdefault(_key[:2], []).append((_key, _english))
del _key, _english


# Tool-search stop words minus the words that carry meaning in documentation ("development server", "--help").
KNOWLEDGE_STOP_WORDS = STOP_WORDS - {"server", "help", "tool", "tools", "mcp"}
